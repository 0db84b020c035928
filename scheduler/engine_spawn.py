"""Starting the engine process, early: it imports the engine (MLX, mlx-lm, the kernels) while the front
end checks its settings and binds, then reads its settings from stdin and loads.

The daemon's command starts it first (``spawn``), before the front end's own imports; a start that is
refused afterwards kills it (``Spawned.discard``), and it has done nothing but import by then: it
reads no model, touches no device and writes nothing until its settings arrive.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from dataclasses import dataclass

from scheduler.event_pipe import open_pipe


@dataclass
class Spawned:
    """An engine process waiting for its settings, and the read end of its event pipe."""

    proc: subprocess.Popen[bytes]
    events: int
    #: The pipe's write end as the child holds it (the same number in both processes).
    events_fd: int

    def send(self, spec: bytes) -> None:
        """The child's settings: it loads once it has them (``OSError`` when it is gone already)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(spec)
            self.proc.stdin.flush()
        finally:
            with contextlib.suppress(OSError):  # closing flushes again what a gone child cannot take
                self.proc.stdin.close()

    def discard(self) -> None:
        """The start was refused: end the child (still importing, or waiting for its settings)."""
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        os.close(self.events)


def spawn(pipe: tuple[int, int] | None = None) -> Spawned:
    """Start ``python -m scheduler.engine_child`` with the write end of ``pipe`` (a new event pipe by
    default). Started from the main thread it dies with this process (the parent-death signal fires
    when the starting thread ends, and the main thread lives as long as the daemon)."""
    events, events_w = pipe or open_pipe()
    die_with_me = threading.current_thread() is threading.main_thread()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler.engine_child", str(os.getpid()), "1" if die_with_me else "0"],
            stdin=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(events_w,),
        )
    except BaseException:
        os.close(events)
        raise
    finally:
        os.close(events_w)  # the child holds the only write end: its end of stream is the child's
    return Spawned(proc, events, events_w)
