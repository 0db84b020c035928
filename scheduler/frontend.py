"""The daemon's front end: a ZeroMQ ROUTER served from an anyio event loop.

It decodes and validates every message, tokenizes prompts off the loop, hands jobs to the
engine thread, and turns the engine's events into wire messages (detokenized text, stop strings,
usage, timings). It never waits on the engine: commands go into the engine's inbox, events come
back through ``loop.call_soon_threadsafe``.

ZeroMQ's asyncio integration needs anyio's asyncio backend; the daemon always runs on it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any, cast

import anyio
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream

from clients.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    ErrorCode,
    FinishReason,
    Health,
    MsgType,
    ProtocolError,
    Stats,
    Submit,
    empty_timings,
    empty_usage,
    end_message,
    error_message,
    pack,
    parse_request,
    token_message,
    unpack,
)
from scheduler.admission import Limits, admit, prompt_ids
from scheduler.fairness import FairQueue
from scheduler.metrics import Observations
from scheduler.stopping import StopStrings
from scheduler.tenants import LOCAL, Tenant, TenantsError, TenantTable, load_tenants, local_table
from workers.engine import Finished, Job, StepInfo, Tokens
from workers.loop import Dead, EngineThread, Ready, Signal, Stopped
from workers.models import ModelInfo

log = logging.getLogger("mlx_batchd")

#: Frames up to this multiple of the limit are read and refused with an error; larger ones
#: are cut off by ZeroMQ itself (ZMQ_MAXMSGSIZE), which drops that client's connection.
HARD_FRAME_FACTOR = 4


@dataclass(frozen=True)
class FrontEndSettings:
    listen: str
    limits: Limits = field(default_factory=Limits)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    drain_timeout: float = 0.0
    send_hwm: int = 100_000
    handle_signals: bool = True
    #: Sequences handed to the engine at once (its batch size); the rest wait in the fair queue.
    capacity: int = 32
    #: Requests waiting for a slot, all tenants together, before new ones are answered ``busy``.
    max_queued: int = 1024
    tenants: Path | None = None
    curve_secret: Path | None = None
    insecure: bool = False
    #: ``HOST:PORT`` for the Prometheus exposition, or ``None``.
    metrics: str | None = None
    #: KV-cache bytes the engine may hold for admitted requests (prompt + max_tokens each); 0 = no cap.
    kv_budget_bytes: int = 0
    #: Requests one connection may have in flight (waiting or decoding) before ``busy``.
    max_inflight_per_client: int = 256


class ConfigError(Exception):
    """A daemon configuration that must not start (with what to change)."""


@dataclass
class _Tracked:
    """One request the daemon owes a terminal event to."""

    client: bytes
    tenant: str
    rid: str
    seq: int
    received_at: float
    req: Submit
    job: Job | None = None
    last_token_at: float | None = None

    @property
    def key(self) -> tuple[str, bytes, str]:
        return (self.tenant, self.client, self.rid)

    detok: Any = None
    stops: StopStrings | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_engine: bool = False
    cancel_requested: bool = False
    stopped: bool = False


class FrontEnd:
    """Owns the socket and the request table; the engine thread owns everything MLX."""

    def __init__(
        self, settings: FrontEndSettings, make_engine: Callable[[Callable[[list[Signal]], None]], EngineThread]
    ) -> None:
        self.settings = settings
        self._make_engine = make_engine
        #: (tenant, connection, request id): a request is reachable only from the connection that sent
        #: it, and only while that connection speaks with the same tenant's key.
        self._by_key: dict[tuple[str, bytes, str], _Tracked] = {}
        self._table = local_table()
        self._fair: FairQueue[_Tracked] = FairQueue()
        self._in_engine = 0
        self._kv_reserved = 0
        self._obs = Observations()
        self._by_seq: dict[int, _Tracked] = {}
        self._seqs = count()
        self._info: ModelInfo | None = None
        self._tokenizer: Any = None
        self._status = "loading"
        self._closing = False
        self._exit_code = 0
        self._tokenize_limiter = anyio.CapacityLimiter(1)
        self._counts = {"received": 0, "refused": 0, "completed": 0}
        self._outcomes: dict[str, dict[str, int]] = {}
        #: The latest ``stats()``, replaced (never mutated) by the loop; metrics scrapes read it.
        self.published: dict[str, Any] = {}
        self._started = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until a signal or ``stop()``; return the process exit code."""
        ctx = zmq.asyncio.Context()
        self._sock = sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.max_frame_bytes * HARD_FRAME_FACTOR)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.settings.send_hwm)
        sock.setsockopt(zmq.LINGER, 2000)
        # ZMTP heartbeats: a peer that vanished without closing (a dead host, a cut cable) is
        # dropped after 6 s, and its requests are then cancelled like any disconnected client's.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        self._table = self._load_table()
        auth = self._secure(ctx, sock)
        self._bind(sock)
        loop = asyncio.get_running_loop()
        # Engine events reach the loop through a stream read by a task: anyio's task APIs (which
        # ``_dispatch`` uses) need a task's context, never a bare ``call_soon_threadsafe`` callback.
        events_in, events_out = anyio.create_memory_object_stream[list[Signal]](math.inf)

        def emit(signals: list[Signal]) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(events_in.send_nowait, signals)

        self._engine_done = anyio.Event()
        self._stop_requested = anyio.Event()
        self._engine = self._make_engine(emit)
        metrics_server = None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._consume_engine_events, events_out)
                self._engine.start()
                if self.settings.handle_signals:
                    tg.start_soon(self._watch_signals)
                if self.settings.metrics is not None:
                    from scheduler.metrics import serve_metrics

                    metrics_server = serve_metrics(self.settings.metrics, lambda: self.published, self._obs.registry)
                    tg.start_soon(self._publish_stats)
                tg.start_soon(self._shutdown_when_asked)
                await self._engine_done.wait()  # set once the engine stopped or died
                tg.cancel_scope.cancel()
            # It has released its MLX state by now; let it finish before the interpreter may exit.
            await anyio.to_thread.run_sync(self._engine.join, 10.0)
        finally:
            if metrics_server is not None:
                metrics_server.shutdown()
            if auth is not None:
                auth.stop()
            sock.close(linger=2000)
            ctx.term()
            self._unlink_ipc()
        return self._exit_code

    def _load_table(self) -> TenantTable:
        s = self.settings
        table = local_table() if s.tenants is None else load_tenants(s.tenants)
        tcp = not s.listen.startswith("ipc://")
        if table.authenticated and s.curve_secret is None:
            raise ConfigError("--tenants needs --curve-secret: tenants are identified by their CURVE keys")
        if tcp and not table.authenticated and not s.insecure:
            raise ConfigError(
                f"refusing to listen on {s.listen} without authentication: give --tenants and --curve-secret "
                "(CURVE keys from `mlx-batchd keys new NAME`), or --insecure to accept anyone who can connect"
            )
        return table

    def _secure(self, ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket) -> Any:
        """CURVE on the socket and a ZAP handler that admits only keys of configured tenants."""
        if not self._table.authenticated:
            if not self.settings.listen.startswith("ipc://"):
                log.warning(
                    "!!! INSECURE: %s has no authentication; anyone who can connect can submit jobs",
                    self.settings.listen,
                )
            return None
        import zmq.auth
        from zmq.auth.asyncio import AsyncioAuthenticator

        assert self.settings.curve_secret is not None
        public, secret = zmq.auth.load_certificate(str(self.settings.curve_secret))
        if secret is None:
            raise ConfigError(f"{self.settings.curve_secret} holds no secret key (use the .key_secret file)")
        auth = AsyncioAuthenticator(ctx)
        auth.start()
        front = self

        class Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                return front._table.by_key(key.decode("ascii")) is not None

        auth.configure_curve_callback("*", credentials_provider=Keys())
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        return auth

    def _bind(self, sock: zmq.asyncio.Socket) -> None:
        addr = self.settings.listen
        if addr.startswith("ipc://"):
            path = Path(addr[len("ipc://") :])
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.parent.chmod(0o700)
            if path.exists():
                path.unlink()  # a stale socket from a daemon that did not exit cleanly
            sock.bind(addr)
            path.chmod(0o600)
        else:
            sock.bind(addr)

    def _unlink_ipc(self) -> None:
        if self.settings.listen.startswith("ipc://"):
            Path(self.settings.listen[len("ipc://") :]).unlink(missing_ok=True)

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
        """SIGHUP: re-read the tenants file. New keys and limits apply to new requests; requests of
        tenants that are gone are refused from now on (their queued ones end ``unauthorized``)."""
        if self.settings.tenants is None:
            return
        try:
            table = load_tenants(self.settings.tenants)
        except TenantsError as exc:
            log.error("tenants file not reloaded, keeping the old one: %s", exc)
            return
        self._table = table
        log.info("tenants reloaded: %s", ", ".join(sorted(table.tenants)))
        for name in list(self._fair.state):
            if name not in table.tenants:
                for t in self._fair.drop_tenant_queue(name):
                    self._finish_here(t, FinishReason.ERROR, (ErrorCode.UNAUTHORIZED, "the tenant was removed"))
        self._pump()

    async def _shutdown_when_asked(self) -> None:
        await self._stop_requested.wait()
        self._closing = True
        self._status = "shutting_down"
        if self.settings.drain_timeout > 0:
            with anyio.move_on_after(self.settings.drain_timeout):
                while self._by_key:
                    await anyio.sleep(0.05)
        self._engine.shutdown()

    # ------------------------------------------------------------------ engine -> clients

    async def _consume_engine_events(self, stream: MemoryObjectReceiveStream[list[Signal]]) -> None:
        async with stream:
            async for signals in stream:
                self._dispatch(signals)

    def _dispatch(self, signals: list[Signal]) -> None:
        """Engine events, on the event loop. After ``Stopped`` or ``Dead`` nothing more comes."""
        if self._engine_done.is_set():
            return
        for sig in signals:
            if isinstance(sig, Tokens):
                self._on_tokens(sig)
            elif isinstance(sig, StepInfo):
                self._obs.step.labels(sig.kind).observe(sig.seconds)
                if sig.kind == "decode":
                    self._obs.batch.observe(sig.batch_size)
            elif isinstance(sig, Finished):
                self._on_finished(sig)
            elif isinstance(sig, Ready):
                self._info, self._tokenizer = sig.info, sig.tokenizer
                self._status = "ready"
                self._tg.start_soon(self._receive)
                log.info("ready: model %s on %s", sig.info.name, self.settings.listen)
                print(f"mlx-batchd ready: model {sig.info.name} listening on {self.settings.listen}", flush=True)
            elif isinstance(sig, Stopped):
                self._end_all_pending(ErrorCode.SHUTDOWN, "the daemon is shutting down")
                self._engine_done.set()
            elif isinstance(sig, Dead):
                log.error("engine died:\n%s", sig.error)
                self._exit_code = 1
                self._end_all_pending(ErrorCode.ENGINE_DEAD, "the engine failed; the daemon is exiting")
                self._engine_done.set()

    def _on_tokens(self, ev: Tokens) -> None:
        t = self._by_seq.get(ev.seq)
        if t is None or t.stopped:
            return
        out_tokens: list[int] = []
        out_lps: list[float] | None = [] if ev.logprobs is not None else None
        text_parts: list[str] = []
        for i, tok in enumerate(ev.tokens):
            out_tokens.append(tok)
            if out_lps is not None and ev.logprobs is not None:
                out_lps.append(ev.logprobs[i])
            t.detok.add_token(tok)
            segment = t.detok.last_segment
            if t.stops is not None:
                segment, hit = t.stops.feed(segment)
                text_parts.append(segment)
                if hit:
                    t.stopped = True
                    self._engine.cancel(t.seq, "stop")
                    break
            else:
                text_parts.append(segment)
        t.completion_tokens += len(out_tokens)
        now = time.monotonic()
        if t.last_token_at is not None and ev.tokens:
            gap = (now - t.last_token_at) / len(ev.tokens)
            for _ in ev.tokens:
                self._obs.itl.observe(gap)
        t.last_token_at = now
        self._obs.generated.labels(ev.mode).inc(len(ev.tokens))
        tenant = self._table.tenants.get(t.tenant)
        if tenant is not None:
            self._fair.generated(tenant, len(ev.tokens))
        self._send(t.client, token_message(t.rid, out_tokens, "".join(text_parts), out_lps))

    def _on_finished(self, ev: Finished) -> None:
        t = self._by_seq.pop(ev.seq, None)
        if t is None:
            return
        self._in_engine -= 1
        self._kv_reserved -= self._kv_need(t)
        self._fair.finished(t.tenant)
        self._pump()
        if self._by_key.get(t.key) is t:
            del self._by_key[t.key]
        reason = FinishReason.STOP if t.stopped else FinishReason(ev.reason)
        if not t.stopped:
            t.detok.finalize()
            tail = t.detok.last_segment
            if t.stops is not None:
                tail, hit = t.stops.feed(tail)
                tail += "" if hit else t.stops.flush()
                reason = FinishReason.STOP if hit else reason
            if tail:
                self._send(t.client, token_message(t.rid, [], tail, [] if t.req.logprobs else None))
        error = None
        if ev.error_code is not None:
            error = (ErrorCode(ev.error_code), ev.error_message or ev.error_code)
        usage = {"prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens}
        self._counts["completed"] += 1
        self._count_outcome(t, reason, error)
        for hist, value in (
            (self._obs.ttft, ev.timings.ttft_s),
            (self._obs.e2e, ev.timings.total_s),
            (self._obs.queue, ev.timings.queue_s),
        ):
            if value is not None:
                hist.observe(value)
        self._send(t.client, end_message(t.rid, reason, usage, ev.timings.as_dict(), error))

    def _end_all_pending(self, code: ErrorCode, message: str) -> None:
        """Requests the engine never answered for (still tokenizing, or the engine is gone)."""
        for t in list(self._by_key.values()):
            self._finish_here(t, FinishReason.ERROR, (code, message))

    def _finish_here(
        self,
        t: _Tracked,
        reason: FinishReason,
        error: tuple[ErrorCode, str] | None,
        retry_after_s: float | None = None,
    ) -> None:
        """End a request the engine does not hold (waiting, refused, or after the engine stopped)."""
        if self._by_key.get(t.key) is t:
            del self._by_key[t.key]
        self._by_seq.pop(t.seq, None)
        self._fair.remove(t.tenant, t)
        timings = empty_timings()
        timings["total_s"] = time.monotonic() - t.received_at
        usage = empty_usage(t.prompt_tokens)
        usage["completion_tokens"] = t.completion_tokens
        self._count_outcome(t, reason, error)
        self._send(t.client, end_message(t.rid, reason, usage, timings, error, retry_after_s))

    def _count_outcome(self, t: _Tracked, reason: FinishReason, error: tuple[ErrorCode, str] | None) -> None:
        """Per tenant: stop / length / cancelled, or the error code (a bounded set)."""
        outcome = error[0].value if error is not None else reason.value
        per = self._outcomes.setdefault(t.tenant, {})
        per[outcome] = per.get(outcome, 0) + 1

    # ------------------------------------------------------------------ clients -> engine

    def _tenant_of(self, frame: zmq.Frame) -> Tenant | None:
        """Who sent this: the CURVE key's tenant (the ZAP User-Id, never anything the client
        says), or ``local`` when no tenants file is in force."""
        if not self._table.authenticated:
            return self._table.tenants[LOCAL]
        return self._table.by_key(str(frame.get("User-Id")))

    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            self._counts["received"] += 1
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
                self._refuse_message(client, exc, msg)
                continue
            tenant = self._tenant_of(frames[1])
            if tenant is None:
                self._refuse(
                    client, ProtocolError(ErrorCode.UNAUTHORIZED, "this key no longer belongs to any tenant", req.id)
                )
                continue
            if isinstance(req, Submit):
                self._on_submit(client, tenant, req)
            elif isinstance(req, Cancel):
                self._on_cancel(tenant, client, req)
            elif isinstance(req, Health):
                self._send(client, self._health(req.id))
            elif isinstance(req, Stats):
                if req.measure_tax:
                    self._engine.measure_tax()
                self._send(
                    client, {"v": PROTOCOL_VERSION, "type": MsgType.STATS.value, "id": req.id, "stats": self.stats()}
                )

    def _refuse_message(self, client: bytes, exc: ProtocolError, msg: dict[str, Any] | None) -> None:
        """A submit with a readable, unused id ends as a request (one ``end`` with the error), so
        a client waiting on that id gets its answer; anything else is an ``error`` event."""
        rid = exc.request_id
        if (
            msg is not None
            and msg.get("type") == MsgType.SUBMIT
            and rid is not None
            and not any(t.rid == rid and t.client == client for t in self._by_key.values())
        ):
            self._counts["refused"] += 1
            timings = empty_timings()
            timings["total_s"] = 0.0
            self._send(client, end_message(rid, FinishReason.ERROR, empty_usage(), timings, (exc.code, exc.message)))
            return
        self._refuse(client, exc)

    def _refuse(self, client: bytes, exc: ProtocolError) -> None:
        """A message that cannot start a request: an ``error`` event, addressed by id if it had one."""
        self._counts["refused"] += 1
        self._send(client, error_message(exc.code, exc.message, exc.request_id))

    def _on_submit(self, client: bytes, tenant: Tenant, req: Submit) -> None:
        key = (tenant.name, client, req.id)
        if key in self._by_key:
            self._refuse(
                client,
                ProtocolError(
                    ErrorCode.DUPLICATE_REQUEST_ID,
                    f"request id {req.id!r} is already in flight on this connection; pick a new id",
                    req.id,
                ),
            )
            return
        t = _Tracked(
            client=client, tenant=tenant.name, rid=req.id, seq=next(self._seqs), received_at=time.monotonic(), req=req
        )
        self._by_key[key] = t
        if self._closing:
            self._finish_here(
                t, FinishReason.ERROR, (ErrorCode.SHUTDOWN, "the daemon is shutting down; no new requests")
            )
            return
        mine = waiting = total = 0  # one pass over what is tracked, the new request included
        for o in self._by_key.values():
            mine += o.client == client
            if not o.in_engine:
                total += 1
                waiting += o.tenant == tenant.name
        waiting, total = waiting - 1, total - 1  # others, not counting this one
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

    async def _tokenize_then_admit(self, t: _Tracked) -> None:
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
        if self._by_key.get(t.key) is not t:
            return  # ended meanwhile (shutdown)
        self._admit(t, ids)

    def _admit(self, t: _Tracked, ids: list[int]) -> None:
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
        t.job = Job(
            seq=t.seq,
            prompt=admitted.prompt,
            max_tokens=admitted.max_tokens,
            sampling=t.req.sampling,
            stop_token_ids=tuple(t.req.stop_token_ids),
            logprobs=t.req.logprobs,
            received_at=t.received_at,
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

    def _kv_need(self, t: _Tracked) -> int:
        assert self._info is not None and t.job is not None
        return (len(t.job.prompt) + t.job.max_tokens) * self._info.kv_bytes_per_token

    def _fits(self, t: _Tracked) -> bool:
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
            if self._by_key.get(t.key) is not t or t.job is None:
                continue
            self._fair.admitted(self._table.tenants[name], t.prompt_tokens)
            self._in_engine += 1
            self._kv_reserved += self._kv_need(t)
            t.in_engine = True
            self._by_seq[t.seq] = t
            self._engine.submit(t.job)

    def _on_cancel(self, tenant: Tenant, client: bytes, req: Cancel) -> None:
        t = self._by_key.get((tenant.name, client, req.id))
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
        info = self._info
        return {
            "v": PROTOCOL_VERSION,
            "type": MsgType.HEALTH.value,
            "id": rid,
            "status": self._status,
            "protocol": PROTOCOL_VERSION,
            "model": None
            if info is None
            else {
                "name": info.name,
                "type": info.model_type,
                "vocab_size": info.vocab_size,
                "context_length": info.context_length,
            },
            "limits": {
                "max_tokens": self.settings.limits.max_tokens_cap,
                "default_max_tokens": self.settings.limits.default_max_tokens,
                "max_frame_bytes": self.settings.max_frame_bytes,
            },
        }

    def stats(self) -> dict[str, Any]:
        return {
            "uptime_s": time.monotonic() - self._started,
            "requests_in_flight": len(self._by_key),
            "messages_received": self._counts["received"],
            "messages_refused": self._counts["refused"],
            "requests_completed": self._counts["completed"],
            "requests_waiting": len(self._fair),
            "kv_reserved_bytes": self._kv_reserved,
            "kv_budget_bytes": self.settings.kv_budget_bytes,
            "outcomes": {tenant: dict(per) for tenant, per in self._outcomes.items()},
            "tenants": {
                name: {
                    "weight": tenant.weight,
                    "active": self._fair.state[name].active if name in self._fair.state else 0,
                    "waiting": self._fair.queued(name),
                    "virtual_counter": self._fair.state[name].counter if name in self._fair.state else 0.0,
                    "served_prompt_tokens": self._fair.state[name].served_prompt_tokens
                    if name in self._fair.state
                    else 0,
                    "served_generated_tokens": self._fair.state[name].served_generated_tokens
                    if name in self._fair.state
                    else 0,
                }
                for name, tenant in self._table.tenants.items()
            },
            "engine": self._engine.snapshot(),
        }

    def _send(self, client: bytes, msg: dict[str, Any]) -> None:
        """Send without ever waiting. A client that is gone or not reading loses its requests,
        which are cancelled so their slots are freed for everyone else.

        The send goes through the asyncio socket (NOBLOCK, so its future is already resolved):
        ZeroMQ's notification fd is edge-triggered, and pyzmq re-arms the pending receive after
        its own sends; a send through a second (shadow) socket object would swallow that edge and
        leave new requests unread while the daemon streams tokens.
        """
        sent = cast("asyncio.Future[Any]", self._sock.send_multipart([client, pack(msg)], flags=zmq.NOBLOCK))
        exc = sent.exception() if sent.done() else None
        if exc is not None:
            if not isinstance(exc, zmq.ZMQError):
                raise exc
            gone = [t for t in self._by_key.values() if t.client == client]
            # Once per client: later sends to it (events already in flight) find nothing left to drop.
            (log.warning if gone else log.debug)("dropping client %s: %s", client.hex(), exc)
            for t in gone:
                del self._by_key[t.key]
                if t.in_engine:
                    self._engine.cancel(t.seq, "cancelled")
                else:
                    self._fair.remove(t.tenant, t)
                    t.cancel_requested = True
