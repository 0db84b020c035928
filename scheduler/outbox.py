"""Sending without ever waiting: each connection's outbox, pausing a connection that reads too
slowly, one frame per step for connections that read ``batch`` messages, and the in-process
connections (``open_local``), whose messages go into a bounded memory stream instead of the socket.

A connection that does not read fast enough gets back-pressure, not a cut: its ZeroMQ queue is
bounded (``max_unsent_per_client``), what does not fit waits in an outbox, in order, and the front
end pauses its sequences until the outbox drains (``on_pause``). ``Outbox`` is the sending half of
``Transport``, which owns the socket and the connection table it reads here.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import anyio
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from clients.messages import batch_message
from clients.protocol import pack

#: How often a full outbox is retried.
OUTBOX_RETRY_S = 0.005

#: Outgoing messages waiting in an outbox: packed frames for ZeroMQ connections, the maps themselves
#: for in-process ones.
_Outgoing = bytes | dict[str, Any]


class Outbox:
    """Every connection's sending state; never waits on a send. The socket (``_sock``), the live
    connections (``_fd_of``) and ``poll`` are the transport's."""

    _sock: zmq.asyncio.Socket
    _fd_of: dict[bytes, int]

    def __init__(
        self,
        *,
        max_unsent_per_client: int,
        on_gone: Callable[[bytes, str], None],
        on_pause: Callable[[bytes, bool], None],
    ) -> None:
        self.max_unsent_per_client = max_unsent_per_client
        self._on_gone = on_gone
        self._on_pause = on_pause
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

    def poll(self) -> None:
        """Apply the disconnects reported so far (the transport's)."""
        raise NotImplementedError

    def _forget_sending(self, client: bytes) -> None:
        """Drop what is kept for sending to a connection that is gone."""
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
