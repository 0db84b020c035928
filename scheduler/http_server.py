"""The daemon's HTTP listeners, the OpenAI-compatible door (``--http``) and the metrics
(``--metrics``): sockets bound early, bounded uvicorn servers on the daemon's loop.

The sockets are bound before the engine starts, so a busy or bad address refuses the start like the
ZeroMQ address does (``BindError``). uvicorn then serves each as a task of the front end's task
group, on the same event loop, with its signal handlers off: the daemon owns SIGINT, SIGTERM and
SIGHUP, and stops the servers itself once every request has had its last event. Both use
``scheduler.http_limits``' protocol: a connection cap below the descriptor limit, and deadlines on
request heads and bodies. Without tenants and ``--insecure`` the HTTP door serves only the
daemon's own user (``scheduler.http_auth.LocalUserOnly``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import uvicorn

from scheduler import peer_uid
from scheduler.binding import BoundFile, unlink_if_same, write_private_key
from scheduler.http_auth import LocalUserOnly, metrics_exposure_problem, new_api_key, split_host_port
from scheduler.http_limits import (
    HEAD_TIMEOUT_S,
    METRICS_MAX_CONNECTIONS,
    ListenerLimits,
    connection_cap,
    protocol_for,
)
from scheduler.settings import BindError, ConfigError, FrontEndSettings
from scheduler.tenants import TenantTable

if TYPE_CHECKING:
    from scheduler.http_front import Front
    from scheduler.observations import Observations

log = logging.getLogger("mlx_batchd")

#: Seconds uvicorn gives open answers to finish once the daemon stops it.
GRACEFUL_S = 2
BACKLOG = 2048


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: they would replace the daemon's own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(address: str) -> socket.socket:
    """A listening TCP socket on ``HOST:PORT``; ``ValueError`` or ``OSError`` saying why not."""
    host, port = split_host_port(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {address}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket (the port it got, when 0 was asked for)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve_app(app: Any, sock: socket.socket, stop: anyio.Event, limits: ListenerLimits) -> None:
    """Serve the ASGI ``app`` on ``sock`` within ``limits`` until ``stop`` is set."""
    config = uvicorn.Config(
        app,
        http=protocol_for(limits),
        ws="none",  # an upgrade would hand the connection to a protocol without the cap and deadlines
        lifespan="off",
        log_config=None,
        log_level="warning",
        access_log=False,
        server_header=False,
        timeout_keep_alive=int(HEAD_TIMEOUT_S),
        timeout_graceful_shutdown=GRACEFUL_S,
        backlog=BACKLOG,
    )
    server = _Server(config)

    async def stop_when_asked() -> None:
        await stop.wait()
        server.should_exit = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_when_asked)
        await server.serve(sockets=[sock])
        tg.cancel_scope.cancel()


async def _publish_stats(front: Front, stop: anyio.Event, period: float = 0.25) -> None:
    """Keep ``front.published`` (what a scrape reads) fresh for ``/metrics`` on the HTTP door."""
    while not stop.is_set():
        front.published = front.stats()
        with anyio.move_on_after(period):
            await stop.wait()


class Listeners:
    """The HTTP and metrics sockets, taken before the engine starts, and what serving them needs:
    the HTTP connection cap, and the local key where only the daemon's own user is served."""

    def __init__(self, settings: FrontEndSettings) -> None:
        self.settings = settings
        self.http: socket.socket | None = None
        self.metrics: socket.socket | None = None
        self.http_cap = 0
        self.key = ""
        self.key_file: tuple[Path, BoundFile] | None = None

    @property
    def any(self) -> bool:
        return self.http is not None or self.metrics is not None

    def bind(self, table: TenantTable) -> None:
        """Take the addresses and write the local key; ``BindError`` saying why not (``ConfigError``
        for a metrics address open to the network without ``--insecure``: it has no keys)."""
        s = self.settings
        if s.metrics is not None:
            from scheduler.exposition import parse_address

            try:
                host, port = parse_address(s.metrics)
                self.metrics = bind(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
            except (ValueError, OSError) as exc:
                raise BindError(f"--metrics {s.metrics}: {exc}") from None
            problem = metrics_exposure_problem(s.metrics, s.insecure)
            if problem is not None:
                raise ConfigError(problem)
            if metrics_exposure_problem(s.metrics, False) is not None:
                log.warning(
                    "!!! INSECURE: --metrics %s shows every tenant's counters to anyone who can connect", s.metrics
                )
        if s.http is None:
            return
        try:
            self.http = bind(s.http)
        except (ValueError, OSError) as exc:
            raise BindError(f"--http {s.http}: {exc}") from None
        self.http_cap = connection_cap(s.http_max_connections, METRICS_MAX_CONNECTIONS if self.metrics else 0)
        if table.authenticated or s.insecure:
            return
        self.key = new_api_key()
        try:
            self.key_file = write_private_key(s.listen, self.key)
        except OSError as exc:
            raise BindError(f"--http {s.http}: cannot write the local HTTP key: {exc.strerror or exc}") from None
        how = "the peer's uid, or " if self._check_uid() else ""
        log.info(
            "local HTTP serves only uid %d (and root), told by %sthe key in %s (Authorization: Bearer)",
            os.geteuid(),
            how,
            self.key_file[0],
        )

    def _check_uid(self) -> bool:
        return self.settings.http_local_auth == "uid" and peer_uid.supported()

    def close(self) -> None:
        for sock in (self.http, self.metrics):
            if sock is not None:
                sock.close()
        if self.key_file is not None:
            unlink_if_same(*self.key_file)

    async def serve(self, front: Front, obs: Observations, stop: anyio.Event) -> None:
        """Serve both until ``stop`` is set (the metrics of ``obs`` and of the published stats, with
        their ``vllm:`` aliases, on the metrics listener and at the HTTP door's ``/metrics``)."""
        from scheduler.exposition import metrics_app

        def model() -> str | None:
            info = front.model_info
            return None if info is None else info.name

        # One app: it registers its collectors.
        exposition = metrics_app(lambda: front.published, obs.registry, model=model, observations=obs)
        async with anyio.create_task_group() as tg:
            if self.http is not None:
                from scheduler.http_app import build_app

                if self.metrics is None:  # the --metrics listener's stats publisher is not running
                    tg.start_soon(_publish_stats, front, stop)
                app: Any = build_app(front, exposition)
                if self.key_file is not None:
                    app = LocalUserOnly(
                        app,
                        lambda: not front.tenant_table.authenticated,
                        self.key,
                        self.key_file[0],
                        self._check_uid(),
                    )
                limits = ListenerLimits(self.http_cap, self.settings.http_body_timeout_s)
                tg.start_soon(serve_app, app, self.http, stop, limits)
            if self.metrics is not None:
                limits = ListenerLimits(METRICS_MAX_CONNECTIONS, HEAD_TIMEOUT_S, "metrics")
                tg.start_soon(serve_app, exposition, self.metrics, stop, limits)
