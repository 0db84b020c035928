"""The front end's connections: the ZeroMQ ROUTER, CURVE, the disconnect monitor and the
connection table (binding the address and unlinking the ipc socket file: ``binding``; sending
without ever waiting, outboxes, pausing and in-process connections: ``outbox``; the connection cap's
ZAP handler: ``zap_gate``; cutting a connection that floods the reader: ``flood``).

Every connection is tracked by its routing id and the file descriptor its messages arrive on
(``ZMQ_SRCFD``); a socket monitor reports disconnects by descriptor, so a connection's requests end
the moment it is gone and a later connection that reuses its routing id finds nothing to read or
cancel. A connection that does not read fast enough gets back-pressure, not a cut (``outbox``).

Input never stops (no receive high-water mark: libzmq aborts when a PING meets a stopped input);
what a connection may queue is bounded by the reader, which cuts a connection that sends faster than
it reads. The ZAP handler refuses handshakes past the connection cap, counted from the monitor.

What a connection's going means for its requests is the front end's business: the transport calls
``on_gone(client, why)`` (after which the front end calls ``forget``) and ``on_pause(client,
paused)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anyio
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from scheduler.binding import BoundFile, bind_listen, unlink_bound
from scheduler.flood import FLOOD_MESSAGES, RCVHWM, shut_down
from scheduler.outbox import OUTBOX_RETRY_S, Outbox
from scheduler.settings import ConfigError
from scheduler.zap_gate import DEFAULT_MAX_CONNECTIONS, ZAP_DOMAIN, ZapGate, fitted_connection_cap

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
#: How often disconnects are looked for while nothing is sent or received.
CONNECTION_POLL_S = 0.1
#: Seconds between two warnings that handshakes are refused or connections cut.
WARN_EVERY_S = 10.0


class Transport(Outbox):
    """The ROUTER socket and every connection's bookkeeping; never waits on a send."""

    def __init__(
        self,
        listen: str,
        *,
        max_frame_bytes: int,
        max_unsent_per_client: int,
        on_gone: Callable[[bytes, str], None],
        on_pause: Callable[[bytes, bool], None],
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        super().__init__(max_unsent_per_client=max_unsent_per_client, on_gone=on_gone, on_pause=on_pause)
        self.listen = listen
        self.max_connections = max_connections
        self.max_frame_bytes = max_frame_bytes
        #: The descriptor each client's connection was last seen on, and back: a disconnect names the
        #: descriptor only. A client that is not here has no live connection as far as we know.
        self._fd_of: dict[bytes, int] = {}
        self._client_on: dict[int, bytes] = {}
        #: The ipc socket file this daemon bound, so exit removes only that file: device, inode and
        #: change time (an inode number alone is reused as soon as a file is deleted).
        self._bound_socket: BoundFile | None = None
        #: Connections seen closed: client id -> (descriptor, when), for ``note_connection``.
        self._closed: dict[bytes, tuple[int, float]] = {}
        #: Messages skipped because a connection already closed had left them queued.
        self.stale_dropped = 0
        #: Descriptors of the connections accepted and not yet closed (handshaking ones included).
        self._live: set[int] = set()
        #: Messages read from each connection since the reader last found the socket empty.
        self._streak: dict[bytes, int] = {}
        #: Handshakes refused for the connection cap, and connections cut for sending faster than
        #: the daemon reads.
        self.refused_connections = 0
        self.flood_cuts = 0
        self._warned_at = -WARN_EVERY_S

    # ------------------------------------------------------------------ socket lifecycle

    def open(self, ctx: zmq.asyncio.Context) -> None:
        """The socket, its monitor and the ZAP handler (on the running event loop) that holds the
        connection cap."""
        self.max_connections = fitted_connection_cap(self.max_connections)
        self._sock = sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes * HARD_FRAME_FACTOR)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.max_unsent_per_client)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT)
        self._monitor = self._open_monitor(ctx, sock)
        self._gate = ZapGate(ctx, self._has_room)
        self._gate.start()

    def close(self) -> None:
        self._gate.stop()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=2000)

    def secure(self, ctx: zmq.asyncio.Context, curve_secret: Path, known_key: Callable[[str], bool]) -> Any:
        """CURVE on the socket, and the ZAP handler admits only keys ``known_key`` accepts (asked
        at each connection, so a reload applies to the next one). Returns the handler (``close``
        stops it too)."""
        import zmq.auth

        public, secret = zmq.auth.load_certificate(str(curve_secret))
        if secret is None:
            raise ConfigError(f"{curve_secret} holds no secret key (use the .key_secret file)")

        class Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                return known_key(key.decode("ascii"))

        self._gate.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=Keys())
        self._sock.curve_secretkey = secret
        self._sock.curve_publickey = public
        self._sock.curve_server = True
        return self._gate

    def bind(self) -> None:
        """Take the address, or raise ``BindError`` (``binding.bind_listen``: an ipc socket's folder
        must be ours and closed to others, and a live socket file is never taken over)."""
        self._bound_socket = bind_listen(self._sock, self.listen)

    def unlink_ipc(self) -> None:
        """Remove the socket file this daemon bound, and only if it is still that file."""
        unlink_bound(self.listen, self._bound_socket)

    async def receive(self) -> list[zmq.Frame]:
        """The next message's frames, after the disconnects reported so far and the sender's
        connection are taken into account. Messages a closed connection left queued are skipped,
        and a connection that sends faster than this reads is cut (``FLOOD_MESSAGES``)."""
        while True:
            try:  # one already queued: pyzmq's short path, without its machinery for waiting
                frames = cast("list[zmq.Frame]", await self._sock.recv_multipart(copy=False, flags=zmq.NOBLOCK))
            except zmq.Again:
                self._streak.clear()  # caught up: nobody is ahead of the reader
                frames = cast("list[zmq.Frame]", await self._sock.recv_multipart(copy=False))
            self.poll()
            client = frames[0].bytes
            if not self.note_connection(client, frames[-1]):
                self.stale_dropped += 1
                continue
            streak = self._streak[client] = self._streak.get(client, 0) + 1
            if streak <= FLOOD_MESSAGES or not self._cut(client):
                return frames

    # ------------------------------------------------------------------ connections

    def _open_monitor(self, ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket) -> zmq.Socket[bytes]:
        """A plain (never awaited) PAIR that receives the ROUTER's disconnect events.

        It is read without waiting, before every send and every message handled, so a disconnect
        that happened before a send is always seen before it."""
        endpoint = f"inproc://mlx-batchd-connections-{id(self)}"
        sock.monitor(endpoint, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        monitor: zmq.Socket[bytes] = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
        monitor.connect(endpoint)
        return monitor

    def poll(self) -> None:
        """Apply the disconnects reported so far."""
        while cast(int, self._monitor.get(zmq.EVENTS)) & zmq.POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._live.add(int(event["value"]))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                fd = int(event["value"])
                self._live.discard(fd)
                client = self._client_on.get(fd)
                if client is not None:
                    self._closed[client] = (fd, time.monotonic())
                    self._on_gone(client, "its connection closed")
        if self._closed:
            cutoff = time.monotonic() - STALE_S
            for client, (_, at) in list(self._closed.items()):
                if at < cutoff:
                    del self._closed[client]

    def _has_room(self) -> bool:
        """Asked by the ZAP handler for each handshake: whether the connections open now (this one
        among them: it was accepted before its handshake began) are within the cap."""
        self.poll()
        if len(self._live) <= self.max_connections:
            return True
        self.refused_connections += 1
        self._warn(
            f"refusing a ZeroMQ handshake: {len(self._live) - 1} connections held, zmq_max_connections is {self.max_connections}"
        )
        return False

    def _cut(self, client: bytes) -> bool:
        """Shut down the socket of a connection that sends faster than the daemon reads; what it
        left queued is skipped and its requests end ``disconnected``. ``False`` if it has no
        descriptor of its own (inproc) or is already gone."""
        self.poll()  # a disconnect already reported means the descriptor may be another's by now
        fd = self._fd_of.get(client, -1)
        if fd < 0 or self._client_on.get(fd) != client:
            return False
        if not shut_down(fd):
            return False
        self.flood_cuts += 1
        self._warn(
            f"cut client {client.hex()}: it sent more than {FLOOD_MESSAGES} messages faster than the daemon reads"
        )
        self._streak.pop(client, None)
        self._closed[client] = (fd, time.monotonic())
        self._on_gone(client, "it sent faster than the daemon reads")
        return True

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("%s (refused so far: %d, cut: %d)", message, self.refused_connections, self.flood_cuts)

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
        self._streak.pop(client, None)
        self._forget_sending(client)

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
