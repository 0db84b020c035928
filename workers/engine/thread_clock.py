"""The calling thread's own account: the CPU seconds it ran and how often the OS took its CPU away.

A decode step lasts as long as the slower of the device's work and the host's (Python building the
graph, launching kernels). The engine thread's CPU seconds inside its steps, next to the steps' wall
seconds, say which it was: close to them, the host is the limit and anything else on that CPU slows
the step; well under them, the thread waited on the device. The involuntary context switches say
whether another thread was given the engine thread's CPU meanwhile. On a GPU host whose B = 1 step
moves between processes with the same plans, these two counters tell a slower host apart from a
slower device.

A reading is two system calls, twice a step: microseconds against a step's milliseconds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

try:
    import resource
except ImportError:  # no ``resource`` module (Windows): switches are not counted
    resource = None  # type: ignore[assignment]

#: Linux's per-thread usage; macOS has none (switches are then not counted: 0).
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


@dataclass(frozen=True)
class ThreadClock:
    """A reading: CPU seconds this thread has run, and its involuntary context switches (0 where the
    OS does not count them per thread)."""

    cpu_seconds: float
    preemptions: int


def read() -> ThreadClock:
    """The calling thread's clock now."""
    cpu = time.thread_time()
    if _RUSAGE_THREAD is None:
        return ThreadClock(cpu, 0)
    return ThreadClock(cpu, resource.getrusage(_RUSAGE_THREAD).ru_nivcsw)


def counts_preemptions() -> bool:
    """Whether this OS counts a thread's involuntary switches (Linux)."""
    return _RUSAGE_THREAD is not None


def thread_cpus(native_id: int | None) -> list[int] | None:
    """The CPUs the OS lets thread ``native_id`` run on (0: the calling thread), ascending; ``None``
    where it has no affinity call (macOS) or the thread is not running."""
    get = getattr(os, "sched_getaffinity", None)
    if get is None or native_id is None:
        return None
    try:
        return sorted(get(native_id))
    except OSError:
        return None
