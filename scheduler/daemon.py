"""Joining the pieces: a front end on anyio's asyncio backend and one engine thread."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from clients.address import default_address
from clients.protocol import DEFAULT_MAX_FRAME_BYTES
from scheduler.admission import Limits
from scheduler.frontend import ConfigError, FrontEnd, FrontEndSettings
from scheduler.tenants import TenantsError
from workers.loop import EngineSettings, EngineThread, Signal

SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class DaemonSettings:
    model: str = "demo"
    listen: str = field(default_factory=default_address)
    context_length: int | None = None
    limits: Limits = field(default_factory=Limits)
    engine: EngineSettings = field(default_factory=EngineSettings)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    drain_timeout: float = 0.0
    max_queued: int = 1024
    tenants: Path | None = None
    curve_secret: Path | None = None
    insecure: bool = False
    metrics: str | None = None
    kv_budget_bytes: int = 0
    max_inflight_per_client: int = 256


def serve(settings: DaemonSettings) -> int:
    """Run the daemon in this (main) thread until SIGINT/SIGTERM; return the exit code."""
    from workers.models import load

    def make_engine(emit: Callable[[list[Signal]], None]) -> EngineThread:
        return EngineThread(lambda: load(settings.model, settings.context_length), emit, settings.engine)

    front = FrontEnd(
        FrontEndSettings(
            listen=settings.listen,
            limits=settings.limits,
            max_frame_bytes=settings.max_frame_bytes,
            drain_timeout=settings.drain_timeout,
            capacity=settings.engine.max_batch,
            max_queued=settings.max_queued,
            tenants=settings.tenants,
            curve_secret=settings.curve_secret,
            insecure=settings.insecure,
            metrics=settings.metrics,
            kv_budget_bytes=settings.kv_budget_bytes,
            max_inflight_per_client=settings.max_inflight_per_client,
        ),
        make_engine,
    )
    # The engine thread and the event loop share the GIL. A short switch interval keeps the
    # loop's bookkeeping from holding up the next decode step by up to the default 5 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return anyio.run(front.run, backend="asyncio")
    except (ConfigError, TenantsError) as exc:
        print(f"mlx-batchd: {exc}", file=sys.stderr)
        return 2
