"""The engine process's events to the daemon: msgpack maps over an OS pipe.

Every decode step sends one message from the engine thread, so the send sits on the step's critical
path. A ZeroMQ PUSH over ipc paid for waking its I/O thread on every send: 40 us a send with the
reader idle between sends (median of 400, this development CPU; ~55 us an emit measured on the H200
host, where a B = 1 decode step is ~7 ms), against 2.7 us for a write to a pipe read by another
process. The pipe is also the liveness signal: its reader sees the end of the stream once every write
end is closed, which is when the engine process is gone, however it went.

Writes block when the pipe is full (the reader is more than the pipe's buffer behind): the engine
then waits for the front end instead of queueing without bound. The buffer is raised to
``PIPE_BYTES`` where the system allows it (Linux), a few hundred steps of events at B = 128.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
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


def read_messages(fd: int) -> Iterator[dict[str, Any]]:
    """The messages written to the pipe whose read end is ``fd``, in order, until every write end
    is closed. A message split across reads is joined; a read waits without holding the GIL."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=0)
    while True:
        data = os.read(fd, READ_BYTES)
        if not data:
            return
        unpacker.feed(data)
        yield from unpacker
