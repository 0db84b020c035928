"""The engine process's events to the daemon: msgpack maps over an OS pipe.

Every decode step sends one message (from the engine process's writer thread, ``engine_outbox``, or
from the engine thread itself between two steps). A ZeroMQ PUSH over ipc paid for waking its I/O
thread on every send, about ten times what a write to a pipe read by another process costs
(``benchmarks/emit_cost_probe.py`` measures both). The pipe is also the liveness signal:
its reader sees the end of the stream once every write end is closed, which is when the engine
process is gone, however it went.

Writes block when the pipe is full (the reader is more than the pipe's buffer behind): the engine
then waits for the front end instead of queueing without bound (through the writer thread's bounded
queue). The buffer is raised to ``PIPE_BYTES`` where the system allows it (Linux), a few hundred steps
of events at B = 128.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import select
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

#: The pipe's buffer where it can be set (Linux's default ceiling for unprivileged processes).
PIPE_BYTES = 1 << 20
#: One read takes at most this much.
READ_BYTES = 1 << 20


def open_pipe() -> tuple[int, int]:
    """A pipe ``(read_fd, write_fd)`` with the larger buffer where the system allows it."""
    r, w = os.pipe()
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is not None:
        try:
            fcntl.fcntl(w, set_size, PIPE_BYTES)
        except OSError:  # over the system's ceiling: the default buffer still works
            pass
    return r, w


def unread(fd: int) -> bool:
    """Whether the pipe whose read end is ``fd`` holds bytes nobody has read yet, or has ended
    (never consumes anything, so it may be asked while another thread or the loop reads)."""
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return False


class PipeWriter:
    """Writes whole msgpack messages to a pipe from any thread (a lock keeps messages whole)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self.broken = False

    def send(self, msg: dict[str, Any]) -> bool:
        """Write ``msg``; ``False`` once the reader is gone (nobody left to tell)."""
        data = memoryview(msgpack.packb(msg, use_bin_type=True))
        with self._lock:
            if self.broken:
                return False
            try:
                while data:
                    data = data[os.write(self._fd, data) :]
            except (BrokenPipeError, OSError):
                self.broken = True
                return False
        return True

    def close(self) -> None:
        with self._lock:
            self.broken = True
            try:
                os.close(self._fd)
            except OSError:
                pass


def _unpacker() -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=0)


def read_messages(fd: int) -> Iterator[dict[str, Any]]:
    """The messages written to the pipe whose read end is ``fd``, in order, until every write end
    is closed. A message split across reads is joined; a read waits without holding the GIL."""
    unpacker = _unpacker()
    while True:
        data = os.read(fd, READ_BYTES)
        if not data:
            return
        unpacker.feed(data)
        yield from unpacker


class Receiver:
    """Hands each message of the pipe ``fd`` to ``on_message`` (which returns ``True`` for the last
    one) and, if the pipe ends before that, calls ``on_end`` on a thread of its own (it may wait for
    the writer's process). Reading starts once ``after`` (a thread) has ended.

    Started from a thread that runs an asyncio event loop (the daemon's), it reads in that loop
    (``add_reader``): each step's message then wakes the loop alone, where a reader thread woke
    itself and then the loop (a second wake and a GIL hand-over per step). Elsewhere it reads on
    a thread of its own."""

    def __init__(
        self, fd: int, on_message: Callable[[dict[str, Any]], bool], on_end: Callable[[], None], name: str
    ) -> None:
        self._fd = fd
        self._on_message = on_message
        self._on_end = on_end
        self._name = name
        self._unpacker = _unpacker()
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Set once the last message was handed over or ``on_end`` returned: the descriptor is free.
        self.done = threading.Event()

    def start(self, after: threading.Thread) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        threading.Thread(target=self._begin, args=(after,), name=self._name, daemon=True).start()

    def _begin(self, after: threading.Thread) -> None:
        after.join()
        loop = self._loop
        if loop is None:
            self._read_here()
            return
        try:
            loop.call_soon_threadsafe(self._attach, loop)
        except RuntimeError:  # the loop closed meanwhile: nobody is left to hand messages to
            self.done.set()

    def _read_here(self) -> None:
        for msg in read_messages(self._fd):
            if self._on_message(msg):
                self.done.set()
                return
        self._ended()

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        os.set_blocking(self._fd, False)
        loop.add_reader(self._fd, self._readable, loop)

    def _readable(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            data = os.read(self._fd, READ_BYTES)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(self._fd)
            threading.Thread(target=self._ended, name=self._name, daemon=True).start()
            return
        self._unpacker.feed(data)
        for msg in self._unpacker:
            if self._on_message(msg):
                loop.remove_reader(self._fd)
                self.done.set()
                return

    def _ended(self) -> None:
        try:
            self._on_end()
        finally:
            self.done.set()
