"""The daemon's front end: the coordinator between the connections, the requests in flight and the
engine, served from an anyio event loop.

It makes the parts, wires them to each other and runs them as tasks of one task group; it never
waits on the engine (commands go into the engine's inbox, events come back through the loop). The
parts do the work:

- ``Transport`` (``scheduler.transport``): the socket, connections and sending;
- ``Flight`` (``scheduler.flight``): the requests in flight, the fair queue, the engine's slots and
  the KV budget;
- ``Intake`` (``scheduler.intake``): messages in, and a submit's way through the limits, tokenizing
  and admission to the fair queue;
- ``Control`` (``scheduler.control``): cancel, pause, disconnect and tenant reload on requests in
  flight, and the ``health`` and ``stats`` replies;
- ``EngineEvents`` (``scheduler.engine_events``): engine events to wire messages;
- ``LocalConnection`` (``scheduler.local``): in-process connections for the HTTP front door.

What stays here is the lifecycle: everything that can refuse the configuration is checked before
the engine starts; then the engine, the tasks, signals (SIGHUP reloads the tenants, SIGINT and
SIGTERM shut down), the drain and the stop.

ZeroMQ's asyncio integration needs anyio's asyncio backend; the daemon always runs on it.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import zmq
import zmq.asyncio

from scheduler.binding import LIVE_SOCKET_TIMEOUT_S
from scheduler.control import Control
from scheduler.engine_events import EngineEvents
from scheduler.engine_process import EngineHandle
from scheduler.flight import REFILL_POLL_S, REFILL_SLACK_S, Flight
from scheduler.intake import Intake
from scheduler.local import LocalConnection
from scheduler.outbox import OUTBOX_RETRY_S
from scheduler.outputs import Outputs
from scheduler.settings import BindError, ConfigError, FrontEndSettings, load_table
from scheduler.stats import Counters
from scheduler.tenants import TenantTable
from scheduler.transport import CONNECTION_POLL_S, HARD_FRAME_FACTOR, Transport
from workers.api import ModelInfo, Ready, Signal

if TYPE_CHECKING:
    from scheduler.http_server import Listeners

__all__ = [
    "CONNECTION_POLL_S",
    "HARD_FRAME_FACTOR",
    "LIVE_SOCKET_TIMEOUT_S",
    "OUTBOX_RETRY_S",
    "REFILL_POLL_S",
    "REFILL_SLACK_S",
    "BindError",
    "ConfigError",
    "FrontEnd",
    "FrontEndSettings",
    "LocalConnection",
]

log = logging.getLogger("mlx_batchd")

#: Seconds a daemon whose engine died after it was ready keeps its doors open before it exits: health
#: (ZeroMQ and HTTP) says ``engine_dead`` (HTTP 503) and new requests are refused, so a health checker
#: or a client between two requests learns why instead of meeting a closed port.
DEAD_LINGER_S = 2.0


class FrontEnd:
    """Runs the loop and coordinates: connections in, admission and the fair queue, the engine,
    messages out. The engine thread owns everything MLX."""

    def __init__(
        self, settings: FrontEndSettings, make_engine: Callable[[Callable[[list[Signal]], None]], EngineHandle]
    ) -> None:
        self.settings = settings
        self._make_engine = make_engine
        counters = Counters()
        self._transport = Transport(
            settings.listen,
            max_frame_bytes=settings.max_frame_bytes,
            max_unsent_per_client=settings.max_unsent_per_client,
            on_gone=lambda client, why: self._control.drop_client(client, why),
            on_pause=lambda client, paused: self._control.set_paused(client, paused),
            max_connections=settings.zmq_max_connections,
        )
        self._flight = Flight(settings, Outputs(), self._transport.send, self._transport.is_paused)
        self._control = Control(settings, self._flight, self._transport, counters)
        self._intake = Intake(settings, self._flight, self._transport, self._control, counters)
        #: The latest ``stats()``, replaced (never mutated) by the loop; metrics scrapes read it.
        self.published: dict[str, Any] = {}
        self._http_url = ""

    # ------------------------------------------------------------------ what the HTTP front door reads

    @property
    def status(self) -> str:
        """``loading``, ``ready``, ``shutting_down`` or ``engine_dead``."""
        return self._flight.status

    @property
    def model_info(self) -> ModelInfo | None:
        return self._flight.info

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer once ready (for the event loop and worker threads, never MLX)."""
        return self._flight.tokenizer

    @property
    def tenant_table(self) -> TenantTable:
        """The tenants in force now (replaced on SIGHUP)."""
        return self._flight.table

    def open_local(self, tenant: str) -> LocalConnection:
        """A new in-process connection whose requests belong to ``tenant`` (checked at each submit,
        so a tenant removed by a reload is refused like a revoked CURVE key)."""
        client = LocalConnection.new_id()
        return LocalConnection(self._intake, tenant, self._transport.open_local(client), client)

    def stats(self, only: str | None = None) -> dict[str, Any]:
        """Counters for the ``stats`` reply and the metrics (``Control.stats``)."""
        return self._control.stats(only)

    def reload_tenants(self) -> None:
        """What SIGHUP does (``Control.reload_tenants``)."""
        self._control.reload_tenants()

    def stop(self) -> None:
        """Begin a clean shutdown (what SIGINT and SIGTERM do)."""
        self._stop_requested.set()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until a signal or ``stop()``; return the process exit code.

        Everything that can refuse the configuration (the tenants file, keys, the socket address, the
        metrics address) is checked before the engine thread starts, so a refusal is one exception
        and never an engine thread left running."""
        from scheduler.http_server import Listeners

        ctx = zmq.asyncio.Context()
        self._transport.open(ctx)
        auth = None
        listeners = Listeners(self.settings)
        try:
            self._flight.table = load_table(self.settings)
            auth = self._secure(ctx)
            self._transport.bind()
            self._bind_listeners(listeners)
            return await self._serve(listeners)
        finally:
            listeners.close()
            if auth is not None:
                auth.stop()
            self._transport.close()
            ctx.term()
            self._transport.unlink_ipc()

    async def _serve(self, listeners: Listeners | None = None) -> int:
        events = EngineEvents(self._flight, self._transport, self._on_ready)
        self._stop_requested = anyio.Event()
        self._flight.engine = engine = self._make_engine(events.emit)
        async with anyio.create_task_group() as tg:
            self._tg = self._intake.tasks = tg
            tg.start_soon(events.consume)
            tg.start_soon(self._transport.tend)
            tg.start_soon(self._control.tend_stalled)
            tg.start_soon(self._flight.pump_on_refill)
            tg.start_soon(self._intake.receive)  # from the start: health answers `loading`
            engine.start()
            if self.settings.handle_signals:
                tg.start_soon(self._watch_signals)
            if self.settings.metrics is not None:
                tg.start_soon(self._publish_stats)
            tg.start_soon(self._shutdown_when_asked)
            self._http_stop, self._http_done = anyio.Event(), anyio.Event()
            if listeners is not None and listeners.any:
                tg.start_soon(self._serve_http, listeners)
            else:
                self._http_done.set()
            await events.done.wait()  # set once the engine stopped or died
            if events.exit_code != 0 and self._flight.info is not None:
                await anyio.sleep(DEAD_LINGER_S)
            await self._stop_http()
            tg.cancel_scope.cancel()
        # It has released its MLX state by now; let it finish before the interpreter may exit.
        await anyio.to_thread.run_sync(engine.join, 10.0)
        await self._transport.flush_before_exit()
        return events.exit_code

    def _on_ready(self, sig: Ready) -> None:
        """The model is loaded: admit the requests that came while it loaded, and say where the
        daemon listens."""
        self._intake.on_ready()
        log.info("ready: model %s on %s", sig.info.name, self.settings.listen)
        print(f"mlx-batchd ready: model {sig.info.name} listening on {self.settings.listen}", flush=True)
        if self.settings.http is not None:
            print(f"mlx-batchd http: OpenAI-compatible API at {self._http_url}/v1", flush=True)

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self.reload_tenants()
                    continue
                log.info("received %s; shutting down", signal.Signals(signum).name)
                self.stop()
                return

    async def _publish_stats(self, period: float = 0.25) -> None:
        while True:
            self.published = self.stats()
            await anyio.sleep(period)

    async def _shutdown_when_asked(self) -> None:
        await self._stop_requested.wait()
        flight = self._flight
        flight.closing = True
        flight.status = "shutting_down"
        if self.settings.drain_timeout > 0:
            with anyio.move_on_after(self.settings.drain_timeout):
                while flight.requests:
                    await anyio.sleep(0.05)
        flight.engine.shutdown()

    # ------------------------------------------------------------------ addresses, taken before the engine starts

    def _secure(self, ctx: zmq.asyncio.Context) -> Any:
        """CURVE on the socket and a ZAP handler that admits only keys of configured tenants."""
        if not self._flight.table.authenticated:
            if not self.settings.listen.startswith("ipc://"):
                log.warning(
                    "!!! INSECURE: %s has no authentication; anyone who can connect can submit jobs",
                    self.settings.listen,
                )
            return None
        assert self.settings.curve_secret is not None
        return self._transport.secure(
            ctx, self.settings.curve_secret, lambda key: self._flight.table.by_key(key) is not None
        )

    def _bind_listeners(self, listeners: Listeners) -> None:
        """Take the HTTP and metrics addresses (before the engine starts: a bad or busy one is a
        ``BindError``)."""
        listeners.bind(self._flight.table)
        if listeners.http is not None:
            from scheduler.http_server import url_of

            self._http_url = url_of(listeners.http)

    async def _serve_http(self, listeners: Listeners) -> None:
        try:
            await listeners.serve(self, self._flight.outputs.obs, self._http_stop)
        finally:
            self._http_done.set()

    async def _stop_http(self, within: float = 3.0) -> None:
        """Let the HTTP servers hand their last answers (the ``shutdown`` ends) to their clients and close."""
        self._http_stop.set()
        with anyio.move_on_after(within):
            await self._http_done.wait()
