"""An opt-in profile of the engine thread, for finding where its step time goes on a device.

``MLX_BATCHD_PROFILE_DIR=DIR`` makes the engine loop run under ``cProfile`` and, when the loop ends,
write ``DIR/engine-PID.prof`` (``pstats``) and ``DIR/engine-PID.txt`` (the top functions by own time
and by cumulative time). Unset, it costs nothing.

Which threads it sees depends on Python: up to 3.11 ``cProfile`` hooks the thread that enabled it
only; from 3.12 it runs on ``sys.monitoring``, which reports every thread's calls to the one profile,
so the engine process's main thread (its ZeroMQ polls) lands inside the engine thread's call tree
(``zmq`` ``poll`` under ``Engine.step``). There, read the engine's own functions' figures and not the
callers of the polls.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workers import envs

ENV = envs.PROFILE_DIR.name


@contextmanager
def profiled(name: str) -> Iterator[None]:
    """Profile the calling thread for the body's duration when ``MLX_BATCHD_PROFILE_DIR`` is set."""
    folder = envs.read(envs.PROFILE_DIR)
    if not folder:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        write(profile, Path(folder) / f"{name}-{os.getpid()}")


def write(profile: cProfile.Profile, stem: Path, top: int = 40) -> None:
    """``stem.prof`` and ``stem.txt`` (top ``top`` by own time, then by cumulative time)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    profile.dump_stats(f"{stem}.prof")
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(top)
    Path(f"{stem}.txt").write_text(text.getvalue())
