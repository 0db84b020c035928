"""Which CPUs the daemon's two processes run on: the front end on a few of its own, the engine process
on the rest (Linux; elsewhere the OS places both).

Every decode step the engine process hands its events to the front end, which wakes, and wakes the
clients in turn. Linux tends to run a woken thread on or near the CPU of the thread that woke it, so
on a small machine the front end and the clients land on the CPU the engine thread was using and
preempt it, and the engine's own threads (its Python thread and MLX's worker) hand work to each other
across CPUs. On a 2-CPU machine, the engine process on one CPU and the front end on the other made
the daemon's small batches markedly faster than leaving both to the OS, and the engine process
alone on one CPU lost nothing at larger batches; on a 16-CPU GPU host the split neither helps nor
hurts.

The split is taken from the CPUs the daemon was started with (``taskset``, a cgroup's cpuset), so it
never widens what the operator allowed. ``cpu_affinity = "off"`` leaves placement to the OS: the choice
for several daemons sharing a small machine, whose engines would otherwise share the same CPUs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

#: The most CPUs the front end gets: one Python process (one thread holds its GIL at a time), its
#: ZeroMQ I/O thread and the tokenizer's threads.
MAX_FRONT_END_CPUS = 4
#: One CPU of every this many goes to the front end (at least one, at most ``MAX_FRONT_END_CPUS``).
CPUS_PER_FRONT_END_CPU = 8


class AffinityError(Exception):
    """The OS refused to move this process onto the CPUs asked for."""


@dataclass(frozen=True)
class CpuSplit:
    """The CPUs each of the daemon's processes may run on."""

    front_end: tuple[int, ...]
    engine: tuple[int, ...]


def allowed_cpus() -> tuple[int, ...] | None:
    """The CPUs the calling thread may run on, ascending; ``None`` where the OS has no affinity call
    (macOS)."""
    get = getattr(os, "sched_getaffinity", None)
    return None if get is None else tuple(sorted(get(0)))  # 0: the calling thread


def plan_split(cpus: Sequence[int] | None) -> CpuSplit | None:
    """The front end on the last of ``cpus`` (one in ``CPUS_PER_FRONT_END_CPU``, 1 to
    ``MAX_FRONT_END_CPUS``), the engine process on the others; ``None`` with fewer than two CPUs,
    where there is nothing to split."""
    if cpus is None or len(cpus) < 2:
        return None
    ordered = sorted(cpus)
    share = min(MAX_FRONT_END_CPUS, max(1, len(ordered) // CPUS_PER_FRONT_END_CPU))
    return CpuSplit(front_end=tuple(ordered[-share:]), engine=tuple(ordered[:-share]))


def pin_process(cpus: Iterable[int]) -> None:
    """Every thread of this process onto ``cpus``; threads started later inherit the mask of the
    thread that starts them. Raises ``AffinityError`` when the OS refuses (a CPU outside this
    process's cpuset); a thread that ends meanwhile is skipped."""
    wanted = set(cpus)
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:
            continue
        except OSError as exc:
            raise AffinityError(f"cannot run on CPUs {sorted(wanted)}: {exc.strerror}") from None


@contextlib.contextmanager
def running_on(cpus: Sequence[int] | None) -> Iterator[None]:
    """This process on ``cpus`` for the block, then on the CPUs its calling thread had before (every
    thread, those started meanwhile included). ``None`` changes nothing. For the bench, whose
    in-process arms run where the daemon's engine process runs."""
    before = allowed_cpus()
    if cpus is None or before is None:
        yield
        return
    pin_process(cpus)
    try:
        yield
    finally:
        pin_process(before)


def _threads() -> list[int]:
    """This process's thread ids (Linux ``/proc``; the calling thread alone elsewhere)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
