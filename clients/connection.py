"""The client's connection: one DEALER socket to the daemon, watched, with every reply routed to its call.

One task (the pump) reads both the socket and its monitor and routes every incoming message by id
to the call that waits for it, so callers in many tasks share one connection. No call waits
forever on a daemon that is not there: ZMTP heartbeats notice a daemon that stopped answering, the
monitor notices a connection that broke, and either ends every call in flight with
``daemon_gone``; a refused CURVE handshake ends them with ``unauthorized``, a handshake refused
because the daemon holds all the connections it allows with ``too_many_connections``; leaving the
client ends them with ``closed``. An ``ipc://`` socket is used only in a folder that is yours alone,
checked before connecting and again on every new connection. The calls themselves are
``client.AsyncClient``'s.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any, Self

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskGroup

from clients.address import default_address, ipc_path, unsafe_reason
from clients.events import ClientError, RequestError
from clients.messages import unbatch
from clients.protocol import DEFAULT_MAX_FRAME_BYTES, ErrorCode, pack, unpack
from clients.route import Route

#: ZMTP heartbeats (milliseconds): a PING every second; no traffic for 3 s after one means the
#: daemon is gone (frozen, or its host unreachable) even though the connection never closed. They
#: are safe here because the socket's input never stops: its receive queue is unbounded (the pump
#: reads everything into the calls' routes anyway, and the daemon bounds what it sends). libzmq 4.3.5
#: aborts the process (``Assertion failed: _input_stopped``, zeromq/libzmq#3937) when a heartbeat
#: timeout re-attaches a connection whose input a full receive queue had stopped, which a 1,000
#: message queue and an event loop blocked for some seconds by the application reached.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
#: Asks the daemon to drop this connection after 6 s of silence (this process frozen).
HEARTBEAT_TTL_MS = 6000
#: The ``type`` of a failure the client puts into a waiting call's queue itself (never on the wire).
_LOCAL_FAILURE = "_local_failure"
#: The ``type`` a request's own deadline puts into its queue when it passes (never on the wire).
_LOCAL_TIMEOUT = "_local_timeout"

#: The ZAP status the daemon refuses a handshake with when it holds all the connections it allows
#: (``scheduler.zap_gate.ZAP_TOO_MANY``); a refused CURVE key is 400. libzmq stops reconnecting
#: after either: the client stays refused until it is made again.
TOO_MANY_CONNECTIONS_STATUS = 500
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)
_MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def address_problem(address: str, *, connected: bool) -> str | None:
    """Why ``address`` must not be used, as one line, or ``None``.

    Only ``ipc://`` addresses are checked: their folder must be a real directory owned by you that
    nobody else may write to, and the socket file, if there, must be yours; otherwise another
    local user could have put a fake daemon there. Before connecting, a folder that does not exist
    yet passes (the daemon creates it, mode 0700, when it starts); once ``connected``, it must exist.
    Abstract sockets (``ipc://@name``) have no file and are not checked.
    """
    path = ipc_path(address)
    if path is None or str(path).startswith("@"):
        return None
    folder = path.parent
    if not connected and not os.path.lexists(folder):
        return None
    reason = unsafe_reason(folder)
    if reason is not None:
        return f"refusing to use {address}: {reason}"
    try:
        owner = os.lstat(path).st_uid
    except FileNotFoundError:
        return None  # nothing there yet, or already removed: nobody else can create it in a safe folder
    except OSError as exc:
        return f"refusing to use {address}: cannot inspect {path}: {exc.strerror}"
    if owner != os.getuid():
        return f"refusing to use {address}: {path} is owned by uid {owner}, not by you (uid {os.getuid()})"
    return None


class Connection:
    """The socket, its monitor and the routes of the calls in flight; ``AsyncClient`` adds the calls."""

    def __init__(
        self,
        address: str | None = None,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        curve_secret: str | None = None,
        server_key: str | None = None,
    ) -> None:
        self.address = address or default_address()
        self.max_frame_bytes = max_frame_bytes
        if (curve_secret is None) != (server_key is None):
            raise ClientError("give both curve_secret and server_key, or neither")
        self.curve_secret = curve_secret
        self.server_key = server_key
        self._routes: dict[str, Route] = {}
        #: Sends in progress, with the failure that cancelled each (``None`` while it runs).
        self._sends: dict[anyio.CancelScope, tuple[str, str] | None] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tg: TaskGroup | None = None
        #: Set once a connection exists and its ipc folder passed the check again.
        self._checked: anyio.Event | None = None
        self._auth_error: str | None = None
        self._refused: str | None = None  # the daemon refused the handshake: too many connections
        self._unsafe: str | None = None
        self._closed = False
        self._up = False  # a connection whose ZMTP handshake completed is open
        self._ever_up = False  # some handshake completed since the client started
        self._gone = False  # a connection that was up went down, and none is up again

    async def __aenter__(self) -> Self:
        problem = address_problem(self.address, connected=False)
        if problem is not None:
            raise RequestError(ErrorCode.UNSAFE_ADDRESS, problem)
        self._checked = anyio.Event()
        if ipc_path(self.address) is None:
            self._checked.set()
        self._ctx = zmq.asyncio.Context()
        try:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 1000)
            self._sock.setsockopt(zmq.RCVHWM, 0)
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            self._sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)
            if self.curve_secret is not None:
                self._setup_curve(self._sock)
            self._monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS)
            self._sock.connect(self.address)
        except BaseException:
            self._teardown()
            raise
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._pump)
        return self

    def _setup_curve(self, sock: zmq.asyncio.Socket) -> None:
        """CURVE keys on the socket; the monitor then turns a refused handshake into ``unauthorized``."""
        import zmq.auth

        try:
            public, secret = zmq.auth.load_certificate(str(self.curve_secret))
            server_public, _ = zmq.auth.load_certificate(str(self.server_key))
        except (OSError, ValueError) as exc:
            raise ClientError(f"cannot read CURVE keys: {exc}") from None
        if secret is None:
            raise ClientError(f"{self.curve_secret} holds no secret key (use NAME.key_secret)")
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        self._closed = True
        self._fail_all(ErrorCode.CLOSED, "the client was closed while this call was in flight")
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(et, exc, tb)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        """Close the sockets and the context. Unsent messages get the linger only while a daemon is
        connected: queued for one that is gone, they would hold ``term()`` for nothing."""
        if self._monitor is not None and self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
        if self._sock is not None:
            self._sock.close(linger=None if self._up else 0)
        if self._ctx is not None:
            self._ctx.term()

    # ------------------------------------------------------------------ the pump

    async def _pump(self) -> None:
        """The one reader of the socket and of its monitor. Reading both in one task keeps the
        order the daemon wrote in: the replies it sent before its connection closed are routed
        before the calls still waiting are failed."""
        assert self._sock is not None and self._monitor is not None
        replies: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        events: zmq.Socket[bytes] = zmq.Socket.shadow(self._monitor.underlying)
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            await poller.poll()
            self._route_replies(replies)
            while True:
                try:
                    raw = events.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_event(raw, replies)

    def _route_replies(self, replies: zmq.Socket[bytes]) -> None:
        """Hand every message waiting on the socket to the call it answers."""
        while True:
            try:
                frames = replies.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = unpack(frames[-1], max_bytes=1 << 30)
            except Exception:
                continue  # nothing a well-behaved daemon sends; drop rather than die
            for one in unbatch(msg):
                route = self._routes.get(str(one.get("id")))
                if route is not None and not route.put(one):
                    self._routes.pop(str(one.get("id")), None)

    def _on_event(self, raw: list[bytes], replies: zmq.Socket[bytes]) -> None:
        from zmq.utils.monitor import parse_monitor_message

        parsed = parse_monitor_message(raw)
        event = parsed["event"]
        if event == zmq.EVENT_CONNECTED:
            self._recheck_address()
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._up, self._ever_up, self._gone, self._auth_error = True, True, False, None
            self._refused = None
        elif event == zmq.EVENT_DISCONNECTED and self._up:
            # Only a connection that was up counts: this event also ends attempts that never
            # completed a handshake (a daemon not listening yet, a refused CURVE key).
            self._up, self._gone = False, True
            self._route_replies(replies)
            self._fail_all(
                ErrorCode.DAEMON_GONE,
                f"the daemon at {self.address} went away (its connection closed or it stopped answering heartbeats)",
            )
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and parsed["value"] == TOO_MANY_CONNECTIONS_STATUS:
            self._refused = (
                f"the daemon at {self.address} refused this connection: it holds as many connections as it "
                "allows (zmq_max_connections); close another client or make this one again later"
            )
            self._fail_all(ErrorCode.TOO_MANY_CONNECTIONS, self._refused, from_daemon=True)
        elif event in _HANDSHAKE_FAILED and self.curve_secret is not None:
            self._on_failed_handshake(event)

    def _on_failed_handshake(self, event: int) -> None:
        """A CURVE handshake that failed: the daemon refused our key (it says so), or it hung up
        because it could not read our hello (our ``server_key`` is not its key). The latter looks
        like any broken connection, so it counts only while no handshake ever succeeded."""
        if event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            self._auth_error = f"the daemon refused this client's CURVE key ({self.address!r})"
        elif not self._ever_up:
            self._auth_error = (
                f"the daemon at {self.address!r} hung up during the CURVE handshake (is server_key its public key?)"
            )
        else:
            return
        self._fail_all(ErrorCode.UNAUTHORIZED, self._auth_error, from_daemon=True)

    def _recheck_address(self) -> None:
        """On every new connection: the folder may not have existed when we connected, or may have
        changed since; nothing is sent until this passes."""
        assert self._checked is not None and self._sock is not None
        problem = address_problem(self.address, connected=True)
        if problem is None:
            self._checked.set()
            return
        self._unsafe = problem
        try:
            self._sock.disconnect(self.address)
        except zmq.ZMQError:
            pass
        self._fail_all(ErrorCode.UNSAFE_ADDRESS, problem)

    def _fail_all(self, code: str, message: str, *, from_daemon: bool = False) -> None:
        """End every call in flight: waiting ones through their queue (after what already arrived
        for them), sending ones by cancelling the send. ``from_daemon`` failures look like a
        daemon's ``error`` reply (a stream ends with an errored ``EndEvent``); the others raise."""
        kind = "error" if from_daemon else _LOCAL_FAILURE
        for rid, route in list(self._routes.items()):
            route.put({"type": kind, "id": rid, "code": code, "message": message})
        for scope, reason in list(self._sends.items()):
            if reason is None:
                self._sends[scope] = (code, message)
                scope.cancel()

    # ------------------------------------------------------------------ plumbing

    def _problem(self) -> RequestError | None:
        """Why no new call can start now, if there is a reason."""
        if self._closed:
            return RequestError(ErrorCode.CLOSED, "this client is closed")
        if self._unsafe is not None:
            return RequestError(ErrorCode.UNSAFE_ADDRESS, self._unsafe)
        if self._auth_error is not None:
            return RequestError(ErrorCode.UNAUTHORIZED, self._auth_error)
        if self._refused is not None:
            return RequestError(ErrorCode.TOO_MANY_CONNECTIONS, self._refused)
        if self._gone:
            return RequestError(ErrorCode.DAEMON_GONE, f"the daemon at {self.address} went away and is not back")
        return None

    async def _send(self, msg: dict[str, Any], timeout: float | None = None) -> None:
        """Send one message, bounded by ``timeout``: a DEALER with no connected peer can block on
        send (no daemon yet, a refused handshake), and an ipc connection is used only once checked."""
        if self._sock is None or self._checked is None:
            raise ClientError("use the client as a context manager: `async with AsyncClient(...) as c:`")
        problem = self._problem()
        if problem is not None:
            raise problem
        frame = pack(msg)
        if len(frame) > self.max_frame_bytes:
            raise ClientError(f"message is {len(frame)} bytes; the daemon accepts at most {self.max_frame_bytes}")
        scope = anyio.CancelScope()
        self._sends[scope] = None
        try:
            with scope, anyio.fail_after(timeout):
                await self._checked.wait()
                await self._sock.send(frame)
        finally:
            reason = self._sends.pop(scope)
        if scope.cancelled_caught and reason is not None:
            raise RequestError(*reason)

    def _open_route(self, rid: str) -> Route:
        if rid in self._routes:
            raise ClientError(f"request id {rid!r} is already in flight on this client")
        route = self._routes[rid] = Route()
        return route

    def _close_route(self, rid: str) -> None:
        route = self._routes.pop(rid, None)
        if route is not None:
            route.close()

    def _expire_route(self, rid: str, seconds: float) -> None:
        """``rid``'s deadline passed: its reader gets a ``TimeoutError`` after what is already routed."""
        route = self._routes.get(rid)
        if route is not None:
            route.put({"type": _LOCAL_TIMEOUT, "id": rid, "seconds": seconds})


def raise_local_failure(msg: dict[str, Any]) -> None:
    """Raise the failure the client queued for a call itself (daemon gone, closed, unsafe address,
    the request's deadline passed)."""
    kind = msg.get("type")
    if kind == _LOCAL_FAILURE:
        raise RequestError(str(msg["code"]), str(msg["message"]), str(msg.get("id")))
    if kind == _LOCAL_TIMEOUT:
        raise TimeoutError(f"request {msg.get('id')} did not end within {msg['seconds']:g} s")
