"""Prometheus exposition (``--metrics HOST:PORT``, and ``/metrics`` on the HTTP door): the ASGI app
that serves the daemon's families (``scheduler.metrics``), vLLM's aliases of them
(``scheduler.vllm_metrics``) and the observed distributions (``scheduler.observations``).

The exposition is served by the daemon's own bounded HTTP server on its event loop
(``scheduler.http_server``: a connection cap, head deadlines), through prometheus_client's ASGI app,
so its bytes are the library's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, make_asgi_app

from scheduler.metrics import StatsCollector
from scheduler.observations import Observations
from scheduler.vllm_metrics import VllmAliases


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too; an empty host is loopback), or ``ValueError`` saying why."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("expected HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:9464")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "127.0.0.1", int(port)


def metrics_app(
    snapshot: Callable[[], Mapping[str, Any]],
    registry: CollectorRegistry,
    *,
    model: Callable[[], str | None] | None = None,
    observations: Observations | None = None,
) -> Any:
    """The ASGI app that serves the exposition of ``registry`` and the published ``snapshot``; with
    ``model`` (the served model's name, ``None`` while loading) also the ``vllm:`` aliases, their
    histograms from ``observations``."""
    registry.register(StatsCollector(snapshot))
    if model is not None:
        registry.register(VllmAliases(snapshot, model, observations))
    return make_asgi_app(registry)
