"""The front end's connections: the ZeroMQ ROUTER, CURVE and ZAP, the disconnect monitor, and
sending without ever waiting (binding the address and unlinking the ipc socket file: ``binding``).

Every connection is tracked by its routing id and the file descriptor its messages arrive on
(``ZMQ_SRCFD``); a socket monitor reports disconnects by descriptor, so a connection's requests end
the moment it is gone and a later connection that reuses its routing id finds nothing to read or
cancel. A connection that does not read fast enough gets back-pressure, not a cut: its ZeroMQ queue
is bounded (``max_unsent_per_client``), what does not fit waits in an outbox, in order, and the
front end pauses its sequences until the outbox drains. In-process connections (``open_local``) get
the same outbox and pausing, with a bounded memory stream in place of the socket.

What a connection's going means for its requests is the front end's business: the transport calls
``on_gone(client, why)`` (after which the front end calls ``forget``) and ``on_pause(client,
paused)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anyio
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from zmq.utils.monitor import parse_monitor_message

from clients.protocol import batch_message, pack
from scheduler.binding import BoundFile, bind_listen, unlink_bound
from scheduler.settings import ConfigError

log = logging.getLogger("mlx_batchd")

#: Frames up to this multiple of the limit are read and refused with an error; larger ones
#: are cut off by ZeroMQ itself (ZMQ_MAXMSGSIZE), which drops that client's connection.
HARD_FRAME_FACTOR = 4
#: The daemon sends no ZMTP heartbeats of its own. libzmq (4.3.5, zeromq/libzmq#3937) aborts the process
#: when its heartbeat timer writes to a connection whose input was stopped by a full pipe and which
#: then hung up, and a client that floods while never reading stops that input. Liveness comes from
#: the peers instead: a client's own heartbeats with a time-to-live (the client library asks for 6 s)
#: make libzmq drop a client that falls silent, TCP keepalives find a host that is gone, and a
#: connection that stops reading is paused, then parked (``Flight``), never holding slots.
TCP_KEEPALIVE_IDLE_S = 30
TCP_KEEPALIVE_INTVL_S = 5
TCP_KEEPALIVE_CNT = 3
#: Seconds the id and descriptor of a connection seen closed are remembered, so that the messages it
#: left queued (delivered after its disconnect) are skipped rather than taken for a new connection.
STALE_S = 10.0
#: How often disconnects are looked for while nothing is sent or received, and how often a full
#: outbox is retried.
CONNECTION_POLL_S = 0.1
OUTBOX_RETRY_S = 0.005


#: Outgoing messages waiting in an outbox: packed frames for ZeroMQ connections, the maps themselves
#: for in-process ones.
_Outgoing = bytes | dict[str, Any]


class Transport:
    """The ROUTER socket and every connection's bookkeeping; never waits on a send."""

    def __init__(
        self,
        listen: str,
        *,
        max_frame_bytes: int,
        max_unsent_per_client: int,
        on_gone: Callable[[bytes, str], None],
        on_pause: Callable[[bytes, bool], None],
    ) -> None:
        self.listen = listen
        self.max_frame_bytes = max_frame_bytes
        self.max_unsent_per_client = max_unsent_per_client
        self._on_gone = on_gone
        self._on_pause = on_pause
        #: The descriptor each client's connection was last seen on, and back: a disconnect names the
        #: descriptor only. A client that is not here has no live connection as far as we know.
        self._fd_of: dict[bytes, int] = {}
        self._client_on: dict[int, bytes] = {}
        #: Messages that did not fit a client's ZeroMQ queue, oldest first; their clients are paused.
        self._outbox: dict[bytes, deque[_Outgoing]] = {}
        #: In-process connections (``open_local``) and the streams their messages go into.
        self._local: dict[bytes, MemoryObjectSendStream[dict[str, Any]]] = {}
        self._paused: set[bytes] = set()
        #: Connections that said they read ``batch`` messages (``Submit.batch``).
        self._batching: set[bytes] = set()
        #: While one step's engine events are handled: what each batching connection is owed, in
        #: order, sent as one frame when the step is done (``end_step``).
        self._step_out: dict[bytes, list[dict[str, Any]]] | None = None
        #: The ipc socket file this daemon bound, so exit removes only that file: device, inode and
        #: change time (an inode number alone is reused as soon as a file is deleted).
        self._bound_socket: BoundFile | None = None
        #: Connections seen closed: client id -> (descriptor, when), for ``note_connection``.
        self._closed: dict[bytes, tuple[int, float]] = {}
        #: Messages skipped because a connection already closed had left them queued.
        self.stale_dropped = 0

    # ------------------------------------------------------------------ socket lifecycle

    def open(self, ctx: zmq.asyncio.Context) -> None:
        self._sock = sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes * HARD_FRAME_FACTOR)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.max_unsent_per_client)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT)
        self._monitor = self._open_monitor(ctx, sock)

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=2000)

    def secure(self, ctx: zmq.asyncio.Context, curve_secret: Path, known_key: Callable[[str], bool]) -> Any:
        """CURVE on the socket and a ZAP handler that admits only keys ``known_key`` accepts (asked
        at each connection, so a reload applies to the next one)."""
        import zmq.auth
        from zmq.auth.asyncio import AsyncioAuthenticator

        public, secret = zmq.auth.load_certificate(str(curve_secret))
        if secret is None:
            raise ConfigError(f"{curve_secret} holds no secret key (use the .key_secret file)")
        auth = AsyncioAuthenticator(ctx)
        auth.start()

        class Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                return known_key(key.decode("ascii"))

        auth.configure_curve_callback("*", credentials_provider=Keys())
        self._sock.curve_secretkey = secret
        self._sock.curve_publickey = public
        self._sock.curve_server = True
        return auth

    def bind(self) -> None:
        """Take the address, or raise ``BindError`` (``binding.bind_listen``: an ipc socket's folder
        must be ours and closed to others, and a live socket file is never taken over)."""
        self._bound_socket = bind_listen(self._sock, self.listen)

    def unlink_ipc(self) -> None:
        """Remove the socket file this daemon bound, and only if it is still that file."""
        unlink_bound(self.listen, self._bound_socket)

    async def receive(self) -> list[zmq.Frame]:
        """The next message's frames, after the disconnects reported so far and the sender's
        connection are taken into account. Messages a closed connection left queued are skipped."""
        while True:
            try:  # one already queued: pyzmq's short path, without its machinery for waiting
                frames = cast("list[zmq.Frame]", await self._sock.recv_multipart(copy=False, flags=zmq.NOBLOCK))
            except zmq.Again:
                frames = cast("list[zmq.Frame]", await self._sock.recv_multipart(copy=False))
            self.poll()
            if self.note_connection(frames[0].bytes, frames[-1]):
                return frames
            self.stale_dropped += 1

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

    def poll(self) -> None:
        """Apply the disconnects reported so far."""
        while cast(int, self._monitor.get(zmq.EVENTS)) & zmq.POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                fd = int(event["value"])
                client = self._client_on.get(fd)
                if client is not None:
                    self._closed[client] = (fd, time.monotonic())
                    self._on_gone(client, "its connection closed")
        if self._closed:
            cutoff = time.monotonic() - STALE_S
            for client, (_, at) in list(self._closed.items()):
                if at < cutoff:
                    del self._closed[client]

    def note_connection(self, client: bytes, frame: zmq.Frame) -> bool:
        """Record which connection (descriptor) a client id speaks on; ``False`` for a message that a
        connection already seen closed had left queued (it names that connection's id and
        descriptor; the descriptor may belong to a new connection by now, which must not be taken
        for it). An id seen on a new descriptor, or a descriptor now used by another id, means the
        old connection is gone (a disconnect we have not been told of): what it left is ended before
        anything else."""
        try:
            fd = int(frame.get(zmq.SRCFD))
        except zmq.ZMQError:
            fd = -1  # inproc: no descriptor; such a peer is only ever seen gone by a failed send
        closed = self._closed.get(client)
        if closed is not None:
            if closed[0] == fd and client not in self._fd_of:
                return False
            del self._closed[client]
        if self._fd_of.get(client, fd) != fd:
            self._on_gone(client, "it reconnected")
        self._fd_of[client] = fd
        if fd < 0:
            return True
        previous = self._client_on.get(fd)
        if previous is not None and previous != client:
            self._on_gone(previous, "its connection closed")
        self._client_on[fd] = client
        return True

    def forget(self, client: bytes) -> None:
        """Drop everything kept for a connection that is gone; nothing at all is sent to its id
        until a new connection with that id sends something itself."""
        fd = self._fd_of.pop(client, None)
        if fd is not None and self._client_on.get(fd) == client:
            del self._client_on[fd]
        self._outbox.pop(client, None)
        self._paused.discard(client)
        self._batching.discard(client)
        local = self._local.pop(client, None)
        if local is not None:
            local.close()

    def open_local(self, client: bytes) -> MemoryObjectReceiveStream[dict[str, Any]]:
        """An in-process connection under id ``client``: its messages go into the returned stream."""
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](self.max_unsent_per_client)
        self._local[client] = send
        return receive

    def is_local(self, client: bytes) -> bool:
        return client in self._local

    def mark_batching(self, client: bytes) -> None:
        self._batching.add(client)

    def is_paused(self, client: bytes) -> bool:
        return client in self._paused

    @property
    def paused_count(self) -> int:
        return len(self._paused)

    @property
    def unsent(self) -> int:
        return sum(len(box) for box in self._outbox.values())

    def outbox_full(self, client: bytes) -> bool:
        return len(self._outbox.get(client, ())) >= self.max_unsent_per_client

    async def tend(self) -> None:
        """Notice disconnects while nothing is sent or received, and drain outboxes."""
        while True:
            self.poll()
            self.flush_outboxes()
            await anyio.sleep(OUTBOX_RETRY_S if self._outbox else CONNECTION_POLL_S)

    async def flush_before_exit(self, within: float = 2.0) -> None:
        """The last events (``shutdown`` ends) of clients that were behind get a bounded chance."""
        with anyio.move_on_after(within):
            while self._outbox:
                self.poll()
                self.flush_outboxes()
                await anyio.sleep(OUTBOX_RETRY_S)

    # ------------------------------------------------------------------ sending

    def begin_step(self) -> None:
        """From now until ``end_step``, what batching connections are sent is gathered."""
        self._step_out = {}

    def end_step(self) -> None:
        """One frame per connection for a step's events (a lone event goes as itself)."""
        out, self._step_out = self._step_out or {}, None
        for client, events in out.items():
            self._send_frame(client, events[0] if len(events) == 1 else batch_message(events))

    def send(self, client: bytes, msg: dict[str, Any]) -> None:
        """Send ``msg`` now, or, while a step's events are handled and ``client`` reads batches,
        add it to what that connection gets in one frame at the end of the step."""
        if self._step_out is not None and client in self._batching:
            self._step_out.setdefault(client, []).append(msg)
        else:
            self._send_frame(client, msg)

    def _send_frame(self, client: bytes, msg: dict[str, Any]) -> None:
        """Send one message without ever waiting, in order, never dropping it while its client lives.

        A client that is gone is reported (``on_gone``). When the client's ZeroMQ queue is full
        (it reads slower than its requests generate), the message goes to the client's outbox,
        later messages queue behind it, and the client is paused until the outbox drains
        (``_flush``).

        The send goes through the asyncio socket (NOBLOCK, so its future is already resolved):
        ZeroMQ's notification fd is edge-triggered, and pyzmq re-arms the pending receive after
        its own sends; a send through a second (shadow) socket object would swallow that edge and
        leave new requests unread while the daemon streams tokens.
        """
        frame: _Outgoing
        if client in self._local:
            frame = msg  # in-process: the map itself, nothing to encode
        else:
            self.poll()
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
            self._on_gone(client, "a send found no connection")

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

    def flush_outboxes(self) -> None:
        for client in list(self._outbox):
            self._flush(client)

    def _flush(self, client: bytes) -> None:
        """Send what waits for ``client`` while its queue takes it; resume it when done."""
        box = self._outbox.get(client)
        while box:
            result = self._try_send(client, box[0])
            if result == "full":
                return
            if result == "gone":
                self._on_gone(client, "a send found no connection")
                return
            box.popleft()
        self._outbox.pop(client, None)
        self._set_paused(client, False)

    def _set_paused(self, client: bytes, paused: bool) -> None:
        if paused == (client in self._paused):
            return
        (self._paused.add if paused else self._paused.discard)(client)
        self._on_pause(client, paused)
