"""The daemon's front end: a ZeroMQ ROUTER served from an anyio event loop.

It decodes and validates every message, tokenizes prompts off the loop, hands jobs to the
engine thread, and turns the engine's events into wire messages (detokenized text, stop strings,
usage, timings). It never waits on the engine: commands go into the engine's inbox, events come
back through ``loop.call_soon_threadsafe``.

Every connection is tracked by its routing id and the file descriptor its messages arrive on
(``ZMQ_SRCFD``); a socket monitor reports disconnects by descriptor, so a connection's requests end
the moment it is gone and a later connection that reuses its routing id finds nothing to read or
cancel. A connection that does not read fast enough gets back-pressure, not a cut: its ZeroMQ queue
is bounded (``max_unsent_per_client``), what does not fit waits in an outbox, in order, and its
sequences are paused in the engine until the outbox drains.

In-process connections (``open_local``, used by the HTTP front door in ``scheduler.http_api``) enter
the same request table, fair queue and limits: their events go into a bounded memory stream instead
of the socket, with the same outbox and pausing when their reader falls behind, and closing one is a
disconnect.

ZeroMQ's asyncio integration needs anyio's asyncio backend; the daemon always runs on it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import signal
import socket
import stat
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any, cast

import anyio
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from zmq.utils.monitor import parse_monitor_message

from clients.address import ipc_path, unsafe_reason
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
    batch_message,
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
from scheduler.engine_process import EngineHandle
from scheduler.fairness import FairQueue
from scheduler.metrics import Observations
from scheduler.stopping import StopStrings
from scheduler.tenants import LOCAL, Tenant, TenantsError, TenantTable, load_tenants, local_table
from workers.engine import Finished, Job, StepInfo, Tokens
from workers.loop import Dead, Ready, Signal, Stopped
from workers.models import ModelInfo
from workers.params import SamplingParams
from workers.prefix_cache import salt_for

log = logging.getLogger("mlx_batchd")

#: Frames up to this multiple of the limit are read and refused with an error; larger ones
#: are cut off by ZeroMQ itself (ZMQ_MAXMSGSIZE), which drops that client's connection.
HARD_FRAME_FACTOR = 4
#: ZMTP heartbeats: a PING every 2 s, and a peer from which nothing at all arrived for 6 s is
#: dropped. Any traffic resets that timeout (libzmq), so a client sending its own heartbeats is never
#: silent, however far behind it reads.
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000
#: How often disconnects are looked for while nothing is sent or received, and how often a full
#: outbox is retried.
CONNECTION_POLL_S = 0.1
#: How often the daemon looks for a tenant that only its token bucket holds back, and the slack
#: added to a refill's due time (a bucket must be above zero, not at it, to start a request).
REFILL_POLL_S = 0.05
REFILL_SLACK_S = 0.001
OUTBOX_RETRY_S = 0.005
#: How long an existing socket file may take to accept a connection before it counts as dead.
LIVE_SOCKET_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class FrontEndSettings:
    listen: str
    limits: Limits = field(default_factory=Limits)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    drain_timeout: float = 0.0
    #: Messages one connection may have in ZeroMQ's queue (its SNDHWM). When that is full the daemon
    #: pauses the connection's sequences and keeps what they had produced in an outbox until it drains;
    #: with that many messages waiting in the outbox, the connection's new messages (except cancels)
    #: go unanswered. docs/reliability.md gives the whole bound.
    max_unsent_per_client: int = 1000
    #: Seconds between two pin-tax measurements asked for with ``stats.measure_tax``; one asked for
    #: sooner gets the last figure.
    tax_min_interval_s: float = 30.0
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
    #: ``HOST:PORT`` for the OpenAI-compatible HTTP front door (``docs/http.md``), or ``None``.
    http: str | None = None
    #: Seconds an HTTP client has to send its whole request body before ``408``.
    http_body_timeout_s: float = 30.0


class ConfigError(Exception):
    """A daemon configuration that must not start (with what to change)."""


class BindError(ConfigError):
    """An address the daemon cannot take (in use, in a folder others control, unparsable). Raised
    before the engine starts, so nothing is left running; the command line exits 1 for it."""


#: Outgoing messages waiting in an outbox: packed frames for ZeroMQ connections, the maps themselves
#: for in-process ones.
_Outgoing = bytes | dict[str, Any]


class LocalConnection:
    """An in-process connection to the front end (the HTTP front door uses one per request).

    Its requests go through exactly the ZeroMQ path (tenant limits, fair queue, admission, stop
    strings, metrics), and ``events`` yields the same maps a ZeroMQ client would receive, one per
    message. Its routing id starts with a zero byte and is 17 bytes long: ZeroMQ's own ids for peers
    are 5 bytes and a peer's chosen id may not start with zero, so no socket peer can ever share it.
    ``close`` is a disconnect: what is still in flight ends ``disconnected`` and frees its slot."""

    def __init__(self, front: FrontEnd, tenant: str, events: MemoryObjectReceiveStream[dict[str, Any]]) -> None:
        self.id = b"\x00" + os.urandom(16)
        self.tenant = tenant
        self.events = events
        self._front = front

    def submit(self, req: Submit) -> None:
        self._front._local_submit(self, req)

    def cancel(self, rid: str) -> None:
        self._front._local_cancel(self, rid)

    def close(self) -> None:
        self._front._close_local(self.id, "its in-process client closed it")
        self.events.close()


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
    #: Its connection is gone: nothing more is sent for it (a new connection may reuse the id).
    detached: bool = False
    #: Its end is on its way (the engine was told to end it): no more tokens are sent.
    muted: bool = False

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
        self, settings: FrontEndSettings, make_engine: Callable[[Callable[[list[Signal]], None]], EngineHandle]
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
        self._counts = {"received": 0, "refused": 0, "completed": 0, "clients_dropped": 0, "messages_dropped": 0}
        self._outcomes: dict[str, dict[str, int]] = {}
        #: The latest ``stats()``, replaced (never mutated) by the loop; metrics scrapes read it.
        self.published: dict[str, Any] = {}
        self._started = time.monotonic()
        #: The descriptor each client's connection was last seen on, and back: a disconnect names the
        #: descriptor only. A client that is not here has no live connection as far as we know.
        self._fd_of: dict[bytes, int] = {}
        self._client_on: dict[int, bytes] = {}
        #: Messages that did not fit a client's ZeroMQ queue, oldest first; their clients are paused.
        self._outbox: dict[bytes, deque[_Outgoing]] = {}
        #: In-process connections (``open_local``) and the streams their messages go into.
        self._local: dict[bytes, MemoryObjectSendStream[dict[str, Any]]] = {}
        self._http_url = ""
        self._paused: set[bytes] = set()
        #: Connections that said they read ``batch`` messages (``Submit.batch``).
        self._batching: set[bytes] = set()
        #: While one step's engine events are handled: what each batching connection is owed, in
        #: order, sent as one frame when the step is done (``_dispatch``).
        self._step_out: dict[bytes, list[dict[str, Any]]] | None = None
        self._tax_asked_at: float | None = None
        #: The ipc socket file this daemon bound, so exit removes only that file: device, inode and
        #: change time (an inode number alone is reused as soon as a file is deleted).
        self._bound_socket: tuple[int, int, int] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Serve until a signal or ``stop()``; return the process exit code.

        Everything that can refuse the configuration (the tenants file, keys, the socket address, the
        metrics address) is checked before the engine thread starts, so a refusal is one exception
        and never an engine thread left running."""
        ctx = zmq.asyncio.Context()
        self._sock = sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.max_frame_bytes * HARD_FRAME_FACTOR)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.settings.max_unsent_per_client)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._monitor = self._open_monitor(ctx, sock)
        auth = metrics_server = http_sock = None
        try:
            self._table = self._load_table()
            auth = self._secure(ctx, sock)
            self._bind(sock)
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
            sock.disable_monitor()
            self._monitor.close(linger=0)
            sock.close(linger=2000)
            ctx.term()
            self._unlink_ipc()

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
            tg.start_soon(self._tend_connections)
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
        await self._flush_before_exit()
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
        if s.http is not None:
            from scheduler.http_auth import exposure_problem

            problem = exposure_problem(s.http, table.authenticated, s.insecure)
            if problem is not None:
                raise ConfigError(problem)
            if exposure_problem(s.http, table.authenticated, False) is not None:
                log.warning(
                    "!!! INSECURE: --http %s has no authentication; anyone who can connect can submit jobs", s.http
                )
        return table

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
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](self.settings.max_unsent_per_client)
        conn = LocalConnection(self, tenant, receive)
        self._local[conn.id] = send
        return conn

    def _local_submit(self, conn: LocalConnection, req: Submit) -> None:
        if conn.id not in self._local:
            raise RuntimeError("submit on a closed local connection")
        tenant = self._table.tenants.get(conn.tenant)
        if tenant is None:
            exc = ProtocolError(ErrorCode.UNAUTHORIZED, f"tenant {conn.tenant!r} no longer exists", req.id)
            self._refuse_message(conn.id, exc, {"type": MsgType.SUBMIT.value})
            return
        self._on_submit(conn.id, tenant, req)

    def _local_cancel(self, conn: LocalConnection, rid: str) -> None:
        tenant = self._table.tenants.get(conn.tenant)
        if tenant is not None and conn.id in self._local:
            self._on_cancel(tenant, conn.id, Cancel(rid))

    def _close_local(self, client: bytes, why: str) -> None:
        if client in self._local:
            self._drop_client(client, why)

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
        """Take the address, or raise ``BindError``. For ``ipc://`` the socket's folder must be ours
        and closed to others (created 0700 if missing; an existing folder's mode is never changed),
        and an existing socket file is removed only if nothing answers on it."""
        addr = self.settings.listen
        path = ipc_path(addr)
        if path is None or str(path).startswith("@"):  # tcp, or a Linux abstract socket (no file)
            self._bind_or_refuse(sock, addr)
            return
        self._own_folder(path.parent, addr)
        self._clear_dead_socket(path, addr)
        self._bind_or_refuse(sock, addr)
        path.chmod(0o600)
        st = os.stat(path)
        self._bound_socket = (st.st_dev, st.st_ino, st.st_ctime_ns)

    @staticmethod
    def _own_folder(folder: Path, addr: str) -> None:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.mkdir(mode=0o700)
            folder.chmod(0o700)  # ours, just made: the mode must not depend on the umask
        except FileExistsError:
            pass
        except OSError as exc:
            raise BindError(f"cannot listen on {addr}: cannot create {folder}: {exc.strerror}") from None
        reason = unsafe_reason(folder)
        if reason is not None:
            raise BindError(
                f"refusing to listen on {addr}: {reason}; use a folder only you can write "
                "(leave --listen out for the private default)"
            )

    @staticmethod
    def _clear_dead_socket(path: Path, addr: str) -> None:
        """Remove a socket file left by a daemon that did not exit cleanly; refuse a live one."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise BindError(
                f"cannot listen on {addr}: {path} exists and is not a socket; remove it or pick another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(LIVE_SOCKET_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # nobody listens: a stale file
            return
        except TimeoutError:
            pass  # a listener too busy to accept is still a listener
        except OSError as exc:
            raise BindError(f"cannot listen on {addr}: cannot check the existing {path}: {exc.strerror}") from None
        finally:
            probe.close()
        raise BindError(f"address in use: a daemon is already listening on {addr}; stop it or pick another --listen")

    @staticmethod
    def _bind_or_refuse(sock: zmq.asyncio.Socket, addr: str) -> None:
        try:
            sock.bind(addr)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise BindError(f"address in use: {addr}; stop what listens there or pick another --listen") from None
            raise BindError(f"cannot listen on {addr}: {exc}") from None

    def _unlink_ipc(self) -> None:
        """Remove the socket file this daemon bound, and only if it is still that file."""
        path = ipc_path(self.settings.listen)
        if path is None or self._bound_socket is None:
            return
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino, st.st_ctime_ns) == self._bound_socket:
            path.unlink(missing_ok=True)

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
        for t in list(self._by_key.values()):
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
                while self._by_key:
                    await anyio.sleep(0.05)
        self._engine.shutdown()

    # ------------------------------------------------------------------ connections

    def _open_monitor(self, ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket) -> zmq.Socket[bytes]:
        """A plain (never awaited) PAIR that receives the ROUTER's disconnect events.

        It is read without waiting, before every send and every message handled, so a disconnect
        that happened before a send is always seen before it."""
        endpoint = f"inproc://mlx-batchd-connections-{id(self)}"
        sock.monitor(endpoint, zmq.EVENT_DISCONNECTED)
        monitor: zmq.Socket[bytes] = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
        monitor.connect(endpoint)
        return monitor

    def _poll_connections(self) -> None:
        """Apply the disconnects reported so far."""
        while cast(int, self._monitor.get(zmq.EVENTS)) & zmq.POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                client = self._client_on.get(int(event["value"]))
                if client is not None:
                    self._drop_client(client, "its connection closed")

    def _note_connection(self, client: bytes, frame: zmq.Frame) -> None:
        """Record which connection (descriptor) a client id speaks on. An id seen on a new
        descriptor, or a descriptor now used by another id, means the old connection is gone (a
        disconnect we have not been told of): what it left is ended before anything else."""
        try:
            fd = int(frame.get(zmq.SRCFD))
        except zmq.ZMQError:
            fd = -1  # inproc: no descriptor; such a peer is only ever seen gone by a failed send
        if self._fd_of.get(client, fd) != fd:
            self._drop_client(client, "it reconnected")
        self._fd_of[client] = fd
        if fd < 0:
            return
        previous = self._client_on.get(fd)
        if previous is not None and previous != client:
            self._drop_client(previous, "its connection closed")
        self._client_on[fd] = client

    def _drop_client(self, client: bytes, why: str) -> None:
        """A connection that is gone: its requests end ``disconnected`` (nobody is left to tell, so
        nothing is sent for them), and nothing at all is sent to its id until a new connection
        with that id sends something itself."""
        fd = self._fd_of.pop(client, None)
        if fd is not None and self._client_on.get(fd) == client:
            del self._client_on[fd]
        self._outbox.pop(client, None)
        self._paused.discard(client)
        self._batching.discard(client)
        local = self._local.pop(client, None)
        if local is not None:
            local.close()
        mine = [t for t in self._by_key.values() if t.client == client]
        if not mine:
            return
        self._counts["clients_dropped"] += 1
        log.warning("client %s is gone (%s): ending its %d requests", client.hex(), why, len(mine))
        lost = (ErrorCode.DISCONNECTED, f"the client's connection was lost ({why})")
        for t in mine:
            t.detached = True
            if t.in_engine:
                del self._by_key[t.key]
                self._engine.cancel(t.seq, FinishReason.ERROR.value, lost[0].value, lost[1])
            else:
                self._finish_here(t, FinishReason.ERROR, lost)

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

    async def _tend_connections(self) -> None:
        """Notice disconnects while nothing is sent or received, and drain outboxes."""
        while True:
            self._poll_connections()
            self._flush_outboxes()
            await anyio.sleep(OUTBOX_RETRY_S if self._outbox else CONNECTION_POLL_S)

    def _send(self, client: bytes, msg: dict[str, Any]) -> None:
        """Send ``msg`` now, or, while a step's events are handled and ``client`` reads batches,
        add it to what that connection gets in one frame at the end of the step."""
        if self._step_out is not None and client in self._batching:
            self._step_out.setdefault(client, []).append(msg)
        else:
            self._send_frame(client, msg)

    def _send_step(self, out: dict[bytes, list[dict[str, Any]]]) -> None:
        """One frame per connection for a step's events (a lone event goes as itself)."""
        for client, events in out.items():
            self._send_frame(client, events[0] if len(events) == 1 else batch_message(events))

    def _send_frame(self, client: bytes, msg: dict[str, Any]) -> None:
        """Send one message without ever waiting, in order, never dropping it while its client lives.

        A client that is gone is dropped (``_drop_client``). When the client's ZeroMQ queue is full
        (it reads slower than its requests generate), the message goes to the client's outbox,
        later messages queue behind it, and the client's sequences are paused until the outbox
        drains (``_flush``).

        The send goes through the asyncio socket (NOBLOCK, so its future is already resolved):
        ZeroMQ's notification fd is edge-triggered, and pyzmq re-arms the pending receive after
        its own sends; a send through a second (shadow) socket object would swallow that edge and
        leave new requests unread while the daemon streams tokens.
        """
        frame: _Outgoing
        if client in self._local:
            frame = msg  # in-process: the map itself, nothing to encode
        else:
            self._poll_connections()
            if client not in self._fd_of:
                return  # gone: its requests were ended when that was noticed
            frame = pack(msg)
        box = self._outbox.get(client)
        if box is not None:
            box.append(frame)
            return
        result = self._try_send(client, frame)
        if result == "full":
            self._outbox[client] = deque([frame])
            self._set_paused(client, True)
        elif result == "gone":
            self._drop_client(client, "a send found no connection")

    def _try_send(self, client: bytes, frame: _Outgoing) -> str:
        """``sent``, ``full`` (its ZeroMQ queue is at the high-water mark, or its in-process stream
        is full) or ``gone``."""
        if isinstance(frame, dict):
            local = self._local.get(client)
            if local is None:
                return "gone"
            try:
                local.send_nowait(frame)
            except anyio.WouldBlock:
                return "full"
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return "gone"
            return "sent"
        sent = cast("asyncio.Future[Any]", self._sock.send_multipart([client, frame], flags=zmq.NOBLOCK))
        exc = sent.exception() if sent.done() else None
        if exc is None:
            return "sent"
        if isinstance(exc, zmq.Again):
            return "full"
        if not isinstance(exc, zmq.ZMQError):
            raise exc
        return "gone"  # EHOSTUNREACH: ROUTER_MANDATORY's word for a peer it does not have

    def _flush_outboxes(self) -> None:
        for client in list(self._outbox):
            self._flush(client)

    def _flush(self, client: bytes) -> None:
        """Send what waits for ``client`` while its queue takes it; resume its sequences when done."""
        box = self._outbox.get(client)
        while box:
            result = self._try_send(client, box[0])
            if result == "full":
                return
            if result == "gone":
                self._drop_client(client, "a send found no connection")
                return
            box.popleft()
        self._outbox.pop(client, None)
        self._set_paused(client, False)

    def _set_paused(self, client: bytes, paused: bool) -> None:
        """Pause or resume every sequence of ``client`` in the engine (its queued requests are
        paused as they enter the engine, in ``_pump``)."""
        if paused == (client in self._paused):
            return
        (self._paused.add if paused else self._paused.discard)(client)
        for t in self._by_seq.values():
            if t.client == client and not t.detached:
                (self._engine.pause if paused else self._engine.resume)(t.seq)

    def _outbox_full(self, client: bytes) -> bool:
        return len(self._outbox.get(client, ())) >= self.settings.max_unsent_per_client

    async def _flush_before_exit(self, within: float = 2.0) -> None:
        """The last events (``shutdown`` ends) of clients that were behind get a bounded chance."""
        with anyio.move_on_after(within):
            while self._outbox:
                self._poll_connections()
                self._flush_outboxes()
                await anyio.sleep(OUTBOX_RETRY_S)

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
        self._step_out = {}
        try:
            self._handle_signals(signals)
        finally:
            out, self._step_out = self._step_out, None
            self._send_step(out)

    def _handle_signals(self, signals: list[Signal]) -> None:
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
        t = self._by_seq.get(ev.seq)
        if t is None or t.stopped or t.muted or t.detached:
            return
        out_tokens: list[int] = []
        out_lps: list[float] | None = [] if ev.logprobs is not None else None
        out_tops: list[list[tuple[int, float]]] | None = [] if ev.top_logprobs is not None else None
        text_parts: list[str] = []
        for i, tok in enumerate(ev.tokens):
            out_tokens.append(tok)
            if out_lps is not None and ev.logprobs is not None:
                out_lps.append(ev.logprobs[i])
            if out_tops is not None and ev.top_logprobs is not None:
                out_tops.append(ev.top_logprobs[i])
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
        self._send(t.client, token_message(t.rid, out_tokens, "".join(text_parts), out_lps, out_tops))

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
        if not (t.stopped or t.muted or t.detached):
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
        if not t.detached:
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
        if not t.detached:
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
            self._poll_connections()
            self._note_connection(client, frames[-1])
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
                if not self._outbox_full(client):
                    self._refuse_message(client, exc, msg)
                continue
            if self._outbox_full(client) and not isinstance(req, Cancel):
                self._counts["messages_dropped"] += 1  # it is not reading: answers would only pile up
                continue
            tenant = self._tenant_of(frames[1])
            if tenant is None:
                self._refuse(
                    client, ProtocolError(ErrorCode.UNAUTHORIZED, "this key no longer belongs to any tenant", req.id)
                )
                continue
            if isinstance(req, Submit):
                if req.batch:
                    self._batching.add(client)
                self._on_submit(client, tenant, req)
            elif isinstance(req, Cancel):
                self._on_cancel(tenant, client, req)
            elif isinstance(req, Health):
                self._send(client, self._health(req.id))
            elif isinstance(req, Stats):
                self._on_stats(client, tenant, req)

    def _on_stats(self, client: bytes, tenant: Tenant, req: Stats) -> None:
        """The operator (or an admin tenant) sees every tenant and may ask for a pin-tax measurement;
        any other tenant sees its own usage and the global aggregates, and ``measure_tax`` is
        ``forbidden`` to it."""
        operator = self._table.is_operator(tenant)
        if req.measure_tax and not operator:
            self._refuse(
                client,
                ProtocolError(
                    ErrorCode.FORBIDDEN,
                    "measure_tax is for the operator: the local user without a tenants file, or a tenant "
                    "with admin = true",
                    req.id,
                ),
            )
            return
        stats = self.stats(None if operator else tenant.name)
        if req.measure_tax:
            stats["measure_tax"] = self._ask_for_tax()
        self._send(client, {"v": PROTOCOL_VERSION, "type": MsgType.STATS.value, "id": req.id, "stats": stats})

    def _ask_for_tax(self) -> str:
        """``queued``, or ``skipped`` within ``tax_min_interval_s`` of the last one queued: each
        measurement stalls decoding for a few forwards, so asking cannot queue more than one."""
        now = time.monotonic()
        if self._tax_asked_at is not None and now - self._tax_asked_at < self.settings.tax_min_interval_s:
            return "skipped"
        self._tax_asked_at = now
        self._engine.measure_tax()
        return "queued"

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
            if t.client in self._paused:
                self._engine.pause(t.seq)

    def _on_cancel(self, tenant: Tenant, client: bytes, req: Cancel) -> None:
        t = self._by_key.get((tenant.name, client, req.id))
        if t is None and self._outbox_full(client):
            self._counts["messages_dropped"] += 1  # not reading: an answer would only grow its outbox
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

    def stats(self, only: str | None = None) -> dict[str, Any]:
        """Counters for the ``stats`` reply and the metrics. ``only`` limits the per-tenant tables
        (``tenants``, ``outcomes``) to that tenant: what a tenant that is not an admin may see."""
        tenants = {n: t for n, t in self._table.tenants.items() if only is None or n == only}
        return {
            "uptime_s": time.monotonic() - self._started,
            "requests_in_flight": len(self._by_key),
            "messages_received": self._counts["received"],
            "messages_refused": self._counts["refused"],
            "messages_dropped": self._counts["messages_dropped"],
            "requests_completed": self._counts["completed"],
            "requests_waiting": len(self._fair),
            "kv_reserved_bytes": self._kv_reserved,
            "kv_budget_bytes": self.settings.kv_budget_bytes,
            "clients_paused": len(self._paused),
            "unsent_messages": sum(len(box) for box in self._outbox.values()),
            "clients_dropped": self._counts["clients_dropped"],
            "outcomes": {t: dict(per) for t, per in self._outcomes.items() if only is None or t == only},
            "tenants": {name: self._tenant_stats(name, tenant) for name, tenant in tenants.items()},
            "engine": self._engine.snapshot(),
        }

    def _tenant_stats(self, name: str, tenant: Tenant) -> dict[str, Any]:
        state = self._fair.state.get(name)
        return {
            "weight": tenant.weight,
            "active": state.active if state else 0,
            "waiting": self._fair.queued(name),
            "virtual_counter": state.counter if state else 0.0,
            "served_prompt_tokens": state.served_prompt_tokens if state else 0,
            "served_generated_tokens": state.served_generated_tokens if state else 0,
        }
