"""The daemon's front end: the coordinator between the connections, the request table, the fair
queue and the engine, served from an anyio event loop.

It decodes and validates every message, tokenizes prompts off the loop, checks them
(``scheduler.admission``), queues them fairly (``scheduler.fairness``) and hands jobs to the engine
as slots free up. It never waits on the engine: commands go into the engine's inbox, events come
back through ``loop.call_soon_threadsafe``. The objects it holds do the rest: ``Transport`` the
socket, connections and sending (``scheduler.transport``); ``RequestTable`` every request in flight
and the counts limits read (``scheduler.requests``); ``Outputs`` engine events to wire messages
(``scheduler.outputs``); ``scheduler.stats`` the ``health`` and ``stats`` replies.

In-process connections (``open_local``, used by the HTTP front door in ``scheduler.http_api``) enter
the same request table, fair queue and limits: their events go into a bounded memory stream instead
of the socket, with the same outbox and pausing when their reader falls behind, and closing one is a
disconnect.

ZeroMQ's asyncio integration needs anyio's asyncio backend; the daemon always runs on it.

This module stays above 400 lines because its one idea is the coordination itself: the path of a
request from its message to the engine (refusals, limits, tokenizing, admission, the fair queue,
slots and the KV budget) and back, and the lifecycle (start, reload, drain, stop) around it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import anyio
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream

from clients.protocol import (
    Cancel,
    ErrorCode,
    FinishReason,
    Health,
    MsgType,
    ProtocolError,
    Stats,
    Submit,
    error_message,
    parse_request,
    unpack,
)
from scheduler.admission import admit, prompt_ids
from scheduler.engine_process import EngineHandle
from scheduler.fairness import FairQueue
from scheduler.outputs import Outputs, refused_submit_end
from scheduler.requests import RequestTable, Tracked
from scheduler.settings import BindError, ConfigError, FrontEndSettings, load_table
from scheduler.stats import (
    Counters,
    TaxGate,
    build_stats,
    health_message,
    measure_tax_forbidden,
    stats_message,
    visible_tenant,
)
from scheduler.stopping import StopStrings
from scheduler.tenants import LOCAL, Tenant, TenantsError, TenantTable, load_tenants, local_table
from scheduler.transport import (
    CONNECTION_POLL_S,
    HARD_FRAME_FACTOR,
    HEARTBEAT_IVL_MS,
    HEARTBEAT_TIMEOUT_MS,
    LIVE_SOCKET_TIMEOUT_S,
    OUTBOX_RETRY_S,
    Transport,
)
from workers.engine import Finished, Job, StepInfo, Tokens
from workers.loop import Dead, Ready, Signal, Stopped
from workers.models import ModelInfo
from workers.params import SamplingParams
from workers.prefix_cache import salt_for

__all__ = [
    "CONNECTION_POLL_S",
    "HARD_FRAME_FACTOR",
    "HEARTBEAT_IVL_MS",
    "HEARTBEAT_TIMEOUT_MS",
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

#: How often the daemon looks for a tenant that only its token bucket holds back, and the slack
#: added to a refill's due time (a bucket must be above zero, not at it, to start a request).
REFILL_POLL_S = 0.05
REFILL_SLACK_S = 0.001


class LocalConnection:
    """An in-process connection to the front end (the HTTP front door uses one per request).

    Its requests go through exactly the ZeroMQ path (tenant limits, fair queue, admission, stop
    strings, metrics), and ``events`` yields the same maps a ZeroMQ client would receive, one per
    message. Its routing id starts with a zero byte and is 17 bytes long: ZeroMQ's own ids for peers
    are 5 bytes and a peer's chosen id may not start with zero, so no socket peer can ever share it.
    ``close`` is a disconnect: what is still in flight ends ``disconnected`` and frees its slot."""

    def __init__(
        self,
        front: FrontEnd,
        tenant: str,
        events: MemoryObjectReceiveStream[dict[str, Any]],
        client_id: bytes | None = None,
    ) -> None:
        self.id = client_id if client_id is not None else self.new_id()
        self.tenant = tenant
        self.events = events
        self._front = front

    @staticmethod
    def new_id() -> bytes:
        return b"\x00" + os.urandom(16)

    def submit(self, req: Submit) -> None:
        self._front._local_submit(self, req)

    def cancel(self, rid: str) -> None:
        self._front._local_cancel(self, rid)

    def close(self) -> None:
        self._front._close_local(self.id, "its in-process client closed it")
        self.events.close()


class FrontEnd:
    """Runs the loop and coordinates: connections in, admission and the fair queue, the engine,
    messages out. The engine thread owns everything MLX."""

    def __init__(
        self, settings: FrontEndSettings, make_engine: Callable[[Callable[[list[Signal]], None]], EngineHandle]
    ) -> None:
        self.settings = settings
        self._make_engine = make_engine
        #: Keyed by (tenant, connection, request id): a request is reachable only from the connection
        #: that sent it, and only while that connection speaks with the same tenant's key.
        self._requests = RequestTable()
        self._table = local_table()
        self._fair: FairQueue[Tracked] = FairQueue()
        self._in_engine = 0
        self._kv_reserved = 0
        self._outputs = Outputs()
        self._obs = self._outputs.obs
        self._transport = Transport(
            settings.listen,
            max_frame_bytes=settings.max_frame_bytes,
            max_unsent_per_client=settings.max_unsent_per_client,
            on_gone=self._drop_client,
            on_pause=self._set_paused,
        )
        self._send = self._transport.send
        self._info: ModelInfo | None = None
        self._tokenizer: Any = None
        self._status = "loading"
        self._closing = False
        self._exit_code = 0
        self._tokenize_limiter = anyio.CapacityLimiter(1)
        self._counters = Counters()
        #: The latest ``stats()``, replaced (never mutated) by the loop; metrics scrapes read it.
        self.published: dict[str, Any] = {}
        self._started = time.monotonic()
        self._http_url = ""
        self._tax = TaxGate(settings.tax_min_interval_s)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until a signal or ``stop()``; return the process exit code.

        Everything that can refuse the configuration (the tenants file, keys, the socket address, the
        metrics address) is checked before the engine thread starts, so a refusal is one exception
        and never an engine thread left running."""
        ctx = zmq.asyncio.Context()
        self._transport.open(ctx)
        auth = metrics_server = http_sock = None
        try:
            self._table = load_table(self.settings)
            auth = self._secure(ctx)
            self._transport.bind()
            metrics_server = self._serve_metrics()
            http_sock = self._bind_http()
            return await self._serve(http_sock)
        finally:
            if http_sock is not None:
                http_sock.close()
            if metrics_server is not None:
                metrics_server.shutdown()
            if auth is not None:
                auth.stop()
            self._transport.close()
            ctx.term()
            self._transport.unlink_ipc()

    async def _serve(self, http_sock: socket.socket | None = None) -> int:
        loop = asyncio.get_running_loop()
        # Engine events reach the loop through a stream read by a task: anyio's task APIs (which
        # ``_dispatch`` uses) need a task's context, never a bare ``call_soon_threadsafe`` callback.
        events_in, events_out = anyio.create_memory_object_stream[list[Signal]](math.inf)

        def emit(signals: list[Signal]) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(events_in.send_nowait, signals)

        self._engine_done = anyio.Event()
        self._stop_requested = anyio.Event()
        self._engine = self._make_engine(emit)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._consume_engine_events, events_out)
            tg.start_soon(self._transport.tend)
            tg.start_soon(self._pump_on_refill)
            self._engine.start()
            if self.settings.handle_signals:
                tg.start_soon(self._watch_signals)
            if self.settings.metrics is not None:
                tg.start_soon(self._publish_stats)
            tg.start_soon(self._shutdown_when_asked)
            if http_sock is not None:
                self._http_stop, self._http_done = anyio.Event(), anyio.Event()
                tg.start_soon(self._serve_http, http_sock)
            await self._engine_done.wait()  # set once the engine stopped or died
            await self._stop_http(http_sock)
            tg.cancel_scope.cancel()
        # It has released its MLX state by now; let it finish before the interpreter may exit.
        await anyio.to_thread.run_sync(self._engine.join, 10.0)
        await self._transport.flush_before_exit()
        return self._exit_code

    def _serve_metrics(self) -> Any:
        """Bind the Prometheus endpoint (before the engine starts: a bad address is a ``BindError``)."""
        if self.settings.metrics is None:
            return None
        from scheduler.metrics import serve_metrics

        try:
            return serve_metrics(self.settings.metrics, lambda: self.published, self._obs.registry)
        except (ValueError, OSError) as exc:
            raise BindError(f"--metrics {self.settings.metrics}: {exc}") from None

    def _bind_http(self) -> socket.socket | None:
        """Take the HTTP address (before the engine starts: a bad or busy one is a ``BindError``)."""
        if self.settings.http is None:
            return None
        from scheduler.http_server import bind, url_of

        try:
            sock = bind(self.settings.http)
        except (ValueError, OSError) as exc:
            raise BindError(f"--http {self.settings.http}: {exc}") from None
        self._http_url = url_of(sock)
        return sock

    async def _serve_http(self, sock: socket.socket) -> None:
        from scheduler.http_server import serve

        try:
            await serve(self, sock, self._http_stop)
        finally:
            self._http_done.set()

    async def _stop_http(self, sock: socket.socket | None, within: float = 3.0) -> None:
        """Let the HTTP server hand its last answers (the ``shutdown`` ends) to its clients and close."""
        if sock is None:
            return
        self._http_stop.set()
        with anyio.move_on_after(within):
            await self._http_done.wait()

    def _secure(self, ctx: zmq.asyncio.Context) -> Any:
        """CURVE on the socket and a ZAP handler that admits only keys of configured tenants."""
        if not self._table.authenticated:
            if not self.settings.listen.startswith("ipc://"):
                log.warning(
                    "!!! INSECURE: %s has no authentication; anyone who can connect can submit jobs",
                    self.settings.listen,
                )
            return None
        assert self.settings.curve_secret is not None
        return self._transport.secure(ctx, self.settings.curve_secret, lambda key: self._table.by_key(key) is not None)

    # ------------------------------------------------------------------ in-process connections

    @property
    def status(self) -> str:
        """``loading``, ``ready`` or ``shutting_down``."""
        return self._status

    @property
    def model_info(self) -> ModelInfo | None:
        return self._info

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer once ready (for the event loop and worker threads, never MLX)."""
        return self._tokenizer

    @property
    def tenant_table(self) -> TenantTable:
        """The tenants in force now (replaced on SIGHUP)."""
        return self._table

    def open_local(self, tenant: str) -> LocalConnection:
        """A new in-process connection whose requests belong to ``tenant`` (checked at each submit,
        so a tenant removed by a reload is refused like a revoked CURVE key)."""
        client = LocalConnection.new_id()
        return LocalConnection(self, tenant, self._transport.open_local(client), client)

    def _local_submit(self, conn: LocalConnection, req: Submit) -> None:
        if not self._transport.is_local(conn.id):
            raise RuntimeError("submit on a closed local connection")
        tenant = self._table.tenants.get(conn.tenant)
        if tenant is None:
            exc = ProtocolError(ErrorCode.UNAUTHORIZED, f"tenant {conn.tenant!r} no longer exists", req.id)
            self._refuse_message(conn.id, exc, {"type": MsgType.SUBMIT.value})
            return
        self._on_submit(conn.id, tenant, req)

    def _local_cancel(self, conn: LocalConnection, rid: str) -> None:
        tenant = self._table.tenants.get(conn.tenant)
        if tenant is not None and self._transport.is_local(conn.id):
            self._on_cancel(tenant, conn.id, Cancel(rid))

    def _close_local(self, client: bytes, why: str) -> None:
        if self._transport.is_local(client):
            self._drop_client(client, why)

    # ------------------------------------------------------------------ signals, reload, shutdown

    def stop(self) -> None:
        """Begin a clean shutdown (what SIGINT and SIGTERM do)."""
        self._stop_requested.set()

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

    def reload_tenants(self) -> None:
        """SIGHUP: re-read the tenants file. New keys and limits apply to new requests; a tenant that
        is gone loses its requests at once (waiting and running ones end ``unauthorized``, one end
        each) and its key is refused from now on. A file that does not load leaves the old table."""
        if self.settings.tenants is None:
            return
        try:
            table = load_tenants(self.settings.tenants)
        except TenantsError as exc:
            log.error("tenants file not reloaded, keeping the old one: %s", exc)
            return
        self._table = table
        log.info("tenants reloaded: %s", ", ".join(sorted(table.tenants)))
        removed = (ErrorCode.UNAUTHORIZED, "the tenant was removed")
        for name in list(self._fair.state):
            if name not in table.tenants:
                for t in self._fair.drop_tenant_queue(name):
                    self._finish_here(t, FinishReason.ERROR, removed)
        for t in list(self._requests):
            if t.tenant not in table.tenants and t.in_engine and not t.muted:
                t.muted = True
                self._engine.cancel(t.seq, FinishReason.ERROR.value, removed[0].value, removed[1])
        self._pump()

    async def _shutdown_when_asked(self) -> None:
        await self._stop_requested.wait()
        self._closing = True
        self._status = "shutting_down"
        if self.settings.drain_timeout > 0:
            with anyio.move_on_after(self.settings.drain_timeout):
                while self._requests:
                    await anyio.sleep(0.05)
        self._engine.shutdown()

    # ------------------------------------------------------------------ connections

    def _drop_client(self, client: bytes, why: str) -> None:
        """A connection that is gone: its requests end ``disconnected`` (nobody is left to tell, so
        nothing is sent for them), and nothing at all is sent to its id until a new connection
        with that id sends something itself."""
        self._transport.forget(client)
        mine = self._requests.of_client(client)
        if not mine:
            return
        self._counters.clients_dropped += 1
        log.warning("client %s is gone (%s): ending its %d requests", client.hex(), why, len(mine))
        lost = (ErrorCode.DISCONNECTED, f"the client's connection was lost ({why})")
        for t in mine:
            t.detached = True
            if t.in_engine:
                self._requests.discard(t)
                self._engine.cancel(t.seq, FinishReason.ERROR.value, lost[0].value, lost[1])
            else:
                self._finish_here(t, FinishReason.ERROR, lost)

    def _set_paused(self, client: bytes, paused: bool) -> None:
        """Pause or resume every sequence of ``client`` in the engine (its queued requests are
        paused as they enter the engine, in ``_pump``)."""
        for t in self._requests.in_engine():
            if t.client == client and not t.detached:
                (self._engine.pause if paused else self._engine.resume)(t.seq)

    async def _pump_on_refill(self) -> None:
        """Start waiting requests when a token bucket refills. Submits and finishes pump too, but a
        rate-limited tenant with nothing running has neither: without this it would wait forever."""
        while True:
            delay = self._fair.next_refill(self._table.tenants, time.monotonic())
            if delay is None:
                await anyio.sleep(REFILL_POLL_S)
                continue
            await anyio.sleep(delay + REFILL_SLACK_S)
            self._pump()

    # ------------------------------------------------------------------ engine -> clients

    async def _consume_engine_events(self, stream: MemoryObjectReceiveStream[list[Signal]]) -> None:
        async with stream:
            async for signals in stream:
                # Steps that arrived while the loop was busy are handled as one: their events
                # for a connection then cost one frame, not one per step.
                while True:
                    try:
                        signals = signals + stream.receive_nowait()
                    except anyio.WouldBlock:
                        break
                self._dispatch(signals)

    def _dispatch(self, signals: list[Signal]) -> None:
        """Engine events, on the event loop. After ``Stopped`` or ``Dead`` nothing more comes."""
        if self._engine_done.is_set():
            return
        self._transport.begin_step()
        try:
            self._handle_signals(signals)
        finally:
            self._transport.end_step()

    def _handle_signals(self, signals: list[Signal]) -> None:
        for sig in signals:
            if isinstance(sig, Tokens):
                self._on_tokens(sig)
            elif isinstance(sig, StepInfo):
                self._outputs.step(sig)
            elif isinstance(sig, Finished):
                self._on_finished(sig)
            elif isinstance(sig, Ready):
                self._info, self._tokenizer = sig.info, sig.tokenizer
                self._status = "ready"
                self._tg.start_soon(self._receive)
                log.info("ready: model %s on %s", sig.info.name, self.settings.listen)
                print(f"mlx-batchd ready: model {sig.info.name} listening on {self.settings.listen}", flush=True)
                if self.settings.http is not None:
                    print(f"mlx-batchd http: OpenAI-compatible API at {self._http_url}/v1", flush=True)
            elif isinstance(sig, Stopped):
                self._end_all_pending(ErrorCode.SHUTDOWN, "the daemon is shutting down")
                self._engine_done.set()
            elif isinstance(sig, Dead):
                log.error("engine died:\n%s", sig.error)
                self._exit_code = 1
                self._end_all_pending(ErrorCode.ENGINE_DEAD, "the engine failed; the daemon is exiting")
                self._engine_done.set()

    def _on_tokens(self, ev: Tokens) -> None:
        t = self._requests.by_seq(ev.seq)
        if t is None or t.stopped or t.muted or t.detached:
            return
        msg, hit = self._outputs.tokens(t, ev)
        if hit:
            self._engine.cancel(t.seq, "stop")
        tenant = self._table.tenants.get(t.tenant)
        if tenant is not None:
            self._fair.generated(tenant, len(ev.tokens))
        self._send(t.client, msg)

    def _on_finished(self, ev: Finished) -> None:
        t = self._requests.pop_seq(ev.seq)
        if t is None:
            return
        self._in_engine -= 1
        self._kv_reserved -= self._kv_need(t)
        self._fair.finished(t.tenant)
        self._pump()
        self._requests.discard(t)
        for msg in self._outputs.finished(t, ev):
            self._send(t.client, msg)

    def _end_all_pending(self, code: ErrorCode, message: str) -> None:
        """Requests the engine never answered for (still tokenizing, or the engine is gone)."""
        for t in list(self._requests):
            self._finish_here(t, FinishReason.ERROR, (code, message))

    def _finish_here(
        self,
        t: Tracked,
        reason: FinishReason,
        error: tuple[ErrorCode, str] | None,
        retry_after_s: float | None = None,
    ) -> None:
        """End a request the engine does not hold (waiting, refused, or after the engine stopped)."""
        self._requests.discard(t)
        self._requests.pop_seq(t.seq)
        self._fair.remove(t.tenant, t)
        end = self._outputs.ended_here(t, reason, error, retry_after_s)
        if end is not None:
            self._send(t.client, end)

    # ------------------------------------------------------------------ clients -> engine

    def _tenant_of(self, frame: zmq.Frame) -> Tenant | None:
        """Who sent this: the CURVE key's tenant (the ZAP User-Id, never anything the client
        says), or ``local`` when no tenants file is in force."""
        if not self._table.authenticated:
            return self._table.tenants[LOCAL]
        return self._table.by_key(str(frame.get("User-Id")))

    async def _receive(self) -> None:
        transport = self._transport
        while True:
            frames = await transport.receive()
            self._counters.received += 1
            client = frames[0].bytes
            if len(frames) != 2:
                self._refuse(
                    client, ProtocolError(ErrorCode.BAD_FRAMES, f"send one frame per message, got {len(frames) - 1}")
                )
                continue
            msg: dict[str, Any] | None = None
            try:
                msg = unpack(frames[1].bytes, self.settings.max_frame_bytes)
                req = parse_request(msg)
            except ProtocolError as exc:
                if not transport.outbox_full(client):
                    self._refuse_message(client, exc, msg)
                continue
            if transport.outbox_full(client) and not isinstance(req, Cancel):
                self._counters.messages_dropped += 1  # it is not reading: answers would only pile up
                continue
            tenant = self._tenant_of(frames[1])
            if tenant is None:
                self._refuse(
                    client, ProtocolError(ErrorCode.UNAUTHORIZED, "this key no longer belongs to any tenant", req.id)
                )
                continue
            if isinstance(req, Submit):
                if req.batch:
                    transport.mark_batching(client)
                self._on_submit(client, tenant, req)
            elif isinstance(req, Cancel):
                self._on_cancel(tenant, client, req)
            elif isinstance(req, Health):
                self._send(client, self._health(req.id))
            elif isinstance(req, Stats):
                self._on_stats(client, tenant, req)

    def _on_stats(self, client: bytes, tenant: Tenant, req: Stats) -> None:
        """What the asker may see (``scheduler.stats``); ``measure_tax`` from a tenant that is not the
        operator is refused ``forbidden``."""
        only = visible_tenant(self._table, tenant)
        if req.measure_tax and only is not None:
            self._refuse(client, measure_tax_forbidden(req.id))
            return
        stats = self.stats(only)
        if req.measure_tax:
            stats["measure_tax"] = self._ask_for_tax()
        self._send(client, stats_message(req.id, stats))

    def _ask_for_tax(self) -> str:
        """``queued`` (a measurement is asked of the engine) or ``skipped`` (``TaxGate``)."""
        answer = self._tax.ask(time.monotonic())
        if answer == "queued":
            self._engine.measure_tax()
        return answer

    def _refuse_message(self, client: bytes, exc: ProtocolError, msg: dict[str, Any] | None) -> None:
        """A submit with a readable, unused id ends as a request (one ``end`` with the error), so
        a client waiting on that id gets its answer; anything else is an ``error`` event."""
        rid = exc.request_id
        if (
            msg is not None
            and msg.get("type") == MsgType.SUBMIT
            and rid is not None
            and not self._requests.has_rid(client, rid)
        ):
            self._counters.refused += 1
            self._send(client, refused_submit_end(rid, (exc.code, exc.message)))
            return
        self._refuse(client, exc)

    def _refuse(self, client: bytes, exc: ProtocolError) -> None:
        """A message that cannot start a request: an ``error`` event, addressed by id if it had one."""
        self._counters.refused += 1
        self._send(client, error_message(exc.code, exc.message, exc.request_id))

    def _on_submit(self, client: bytes, tenant: Tenant, req: Submit) -> None:
        requests = self._requests
        if (tenant.name, client, req.id) in requests:
            self._refuse(
                client,
                ProtocolError(
                    ErrorCode.DUPLICATE_REQUEST_ID,
                    f"request id {req.id!r} is already in flight on this connection; pick a new id",
                    req.id,
                ),
            )
            return
        t = Tracked(
            client=client,
            tenant=tenant.name,
            rid=req.id,
            seq=requests.next_seq(),
            received_at=time.monotonic(),
            req=req,
        )
        requests.add(t)
        if self._closing:
            self._finish_here(
                t, FinishReason.ERROR, (ErrorCode.SHUTDOWN, "the daemon is shutting down; no new requests")
            )
            return
        mine = requests.client_count(client)  # the new request included
        waiting, total = requests.waiting(tenant.name) - 1, requests.waiting() - 1  # others, not this one
        if mine > self.settings.max_inflight_per_client:
            self._finish_here(
                t,
                FinishReason.ERROR,
                (
                    ErrorCode.BUSY,
                    f"busy: this connection has {mine - 1} requests in flight "
                    f"(limit {self.settings.max_inflight_per_client}); wait for some to end",
                ),
                1.0,
            )
            return
        if waiting >= tenant.max_queued or total >= self.settings.max_queued:
            which = (
                f"tenant {tenant.name!r} has {waiting} requests waiting (limit {tenant.max_queued})"
                if waiting >= tenant.max_queued
                else f"{total} requests are waiting (limit {self.settings.max_queued})"
            )
            retry = min(30.0, max(0.1, 0.05 * (total + 1)))
            self._finish_here(t, FinishReason.ERROR, (ErrorCode.BUSY, f"busy: {which}; retry later"), retry)
            return
        if req.tokens is not None:
            self._admit(t, list(req.tokens))  # nothing to tokenize: admit in order, at once
        else:
            self._tg.start_soon(self._tokenize_then_admit, t)

    async def _tokenize_then_admit(self, t: Tracked) -> None:
        assert self._info is not None
        try:
            ids = await anyio.to_thread.run_sync(
                prompt_ids, t.req, self._tokenizer, self._info, limiter=self._tokenize_limiter
            )
        except ProtocolError as exc:
            self._finish_here(t, FinishReason.ERROR, (exc.code, exc.message))
            return
        except Exception as exc:
            self._finish_here(t, FinishReason.ERROR, (ErrorCode.BAD_FIELD, f"could not tokenize the prompt: {exc}"))
            return
        if not self._requests.holds(t):
            return  # ended meanwhile (shutdown)
        self._admit(t, ids)

    def _admit(self, t: Tracked, ids: list[int]) -> None:
        assert self._info is not None
        if t.cancel_requested:
            self._finish_here(t, FinishReason.CANCELLED, None)
            return
        if self._closing:
            self._finish_here(
                t, FinishReason.ERROR, (ErrorCode.SHUTDOWN, "the daemon is shutting down; no new requests")
            )
            return
        tenant = self._table.tenants.get(t.tenant)
        if tenant is None:
            self._finish_here(t, FinishReason.ERROR, (ErrorCode.UNAUTHORIZED, "the tenant was removed"))
            return
        try:
            admitted = admit(t.req, ids, self._info, self.settings.limits, tenant)
        except ProtocolError as exc:
            self._finish_here(t, FinishReason.ERROR, (exc.code, exc.message))
            return
        t.prompt_tokens = len(admitted.prompt)
        t.detok = self._tokenizer.detokenizer
        t.stops = StopStrings(t.req.stop) if t.req.stop else None
        wire = t.req.sampling  # the one conversion from the wire's sampling options to the engine's
        t.job = Job(
            seq=t.seq,
            prompt=admitted.prompt,
            max_tokens=admitted.max_tokens,
            sampling=SamplingParams(
                temperature=wire.temperature, top_p=wire.top_p, top_k=wire.top_k, min_p=wire.min_p, seed=wire.seed
            ),
            stop_token_ids=tuple(t.req.stop_token_ids),
            logprobs=t.req.logprobs,
            received_at=t.received_at,
            cache_salt=salt_for(tenant.name, tenant.share_prefix_cache),
            top_logprobs=t.req.top_logprobs,
        )
        budget = self.settings.kv_budget_bytes
        if budget and self._kv_need(t) > budget:
            need_mb, budget_mb = self._kv_need(t) / 2**20, budget / 2**20
            self._finish_here(
                t,
                FinishReason.ERROR,
                (
                    ErrorCode.KV_BUDGET,
                    f"this request needs {need_mb:.1f} MiB of KV cache (prompt + max_tokens) but the daemon's whole "
                    f"budget is {budget_mb:.1f} MiB; lower max_tokens or shorten the prompt",
                ),
            )
            return
        self._fair.push(tenant, t, min(t.req.priority, tenant.priority_ceiling))
        self._pump()

    def _kv_need(self, t: Tracked) -> int:
        assert self._info is not None and t.job is not None
        return (len(t.job.prompt) + t.job.max_tokens) * self._info.kv_bytes_per_token

    def _fits(self, t: Tracked) -> bool:
        budget = self.settings.kv_budget_bytes
        return not budget or t.job is None or self._kv_reserved + self._kv_need(t) <= budget

    def _pump(self) -> None:
        """Hand waiting requests to the engine while it has free slots, fairest tenant first."""
        now = time.monotonic()
        while self._in_engine < self.settings.capacity and not self._closing:
            nxt = self._fair.pop(self._table.tenants, now, self._fits)
            if nxt is None:
                return
            name, t = nxt
            if not self._requests.holds(t) or t.job is None:
                continue
            self._fair.admitted(self._table.tenants[name], t.prompt_tokens)
            self._in_engine += 1
            self._kv_reserved += self._kv_need(t)
            self._requests.enter_engine(t)
            self._engine.submit(t.job)
            if self._transport.is_paused(t.client):
                self._engine.pause(t.seq)

    def _on_cancel(self, tenant: Tenant, client: bytes, req: Cancel) -> None:
        t = self._requests.get((tenant.name, client, req.id))
        if t is None and self._transport.outbox_full(client):
            self._counters.messages_dropped += 1  # not reading: an answer would only grow its outbox
            return
        if t is None:
            self._refuse(
                client,
                ProtocolError(
                    ErrorCode.UNKNOWN_REQUEST_ID,
                    f"no request {req.id!r} of yours is in flight on this connection (finished already, or never sent)",
                    req.id,
                ),
            )
            return
        if t.in_engine:
            self._engine.cancel(t.seq, "cancelled")
        elif t.job is not None:
            self._finish_here(t, FinishReason.CANCELLED, None)  # waiting for a slot
        else:
            t.cancel_requested = True  # still tokenizing: ends when admission sees the flag

    # ------------------------------------------------------------------ replies

    def _health(self, rid: str) -> dict[str, Any]:
        s = self.settings
        return health_message(rid, self._status, self._info, s.limits, s.max_frame_bytes)

    def stats(self, only: str | None = None) -> dict[str, Any]:
        """Counters for the ``stats`` reply and the metrics. ``only`` limits the per-tenant tables
        (``tenants``, ``outcomes``) to that tenant: what a tenant that is not an admin may see."""
        return build_stats(
            only=only,
            uptime_s=time.monotonic() - self._started,
            tenants=self._table.tenants,
            fair=self._fair,
            counters=self._counters,
            completed=self._outputs.completed,
            outcomes=self._outputs.outcomes,
            requests_in_flight=len(self._requests),
            kv_reserved_bytes=self._kv_reserved,
            kv_budget_bytes=self.settings.kv_budget_bytes,
            clients_paused=self._transport.paused_count,
            unsent_messages=self._transport.unsent,
            engine=self._engine.snapshot(),
        )
