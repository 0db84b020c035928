"""The daemon's CPU split (``scheduler.affinity``): how the CPUs it was given are shared between the
front end and the engine process, and moving a whole process (every thread) onto CPUs and back."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from scheduler.affinity import AffinityError, CpuSplit, allowed_cpus, pin_process, plan_split, running_on

needs_affinity = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux's per-thread affinity and at least two CPUs",
)


def test_fewer_than_two_cpus_split_nothing() -> None:
    assert plan_split(None) is None
    assert plan_split([]) is None
    assert plan_split([3]) is None


@pytest.mark.parametrize(
    ("cpus", "front_end"),
    [
        (range(2), (1,)),
        (range(8), (7,)),
        (range(16), (14, 15)),
        (range(31), (28, 29, 30)),
        (range(128), (124, 125, 126, 127)),  # at most four, however many there are
        ([9, 2, 5], (9,)),  # what the daemon was given, in any order, gaps kept
    ],
)
def test_the_front_end_gets_the_last_cpus_one_in_eight(cpus: range | list[int], front_end: tuple[int, ...]) -> None:
    split = plan_split(list(cpus))
    rest = tuple(c for c in sorted(cpus) if c not in front_end)
    assert split == CpuSplit(front_end=front_end, engine=rest)


def _masks() -> dict[int, set[int]]:
    """Every live thread's CPUs (one that ends meanwhile is left out)."""
    masks = {}
    for t in os.listdir("/proc/self/task"):
        try:
            masks[int(t)] = os.sched_getaffinity(int(t))
        except ProcessLookupError:
            continue
    return masks


@needs_affinity
def test_running_on_moves_every_thread_and_puts_them_back() -> None:
    before = set(os.sched_getaffinity(0))
    target = (min(before),)
    started = threading.Event()
    stop = threading.Event()

    def idle() -> None:
        started.set()
        stop.wait(30)

    early = threading.Thread(target=idle, daemon=True)
    late = threading.Thread(target=stop.wait, args=(30,), daemon=True)
    early.start()  # a thread that exists before the move
    started.wait(5)
    try:
        with running_on(target):
            late.start()  # one started during it inherits the mask
            inside = _masks()
        after = _masks()
    finally:
        stop.set()
        early.join(5)
        if late.ident is not None:
            late.join(5)
    assert early.native_id in inside and late.native_id in inside
    assert all(m == {target[0]} for m in inside.values()), inside
    assert all(m == before for m in after.values()), after
    assert allowed_cpus() == tuple(sorted(before))


@needs_affinity
def test_running_on_nothing_changes_nothing() -> None:
    before = _masks()
    with running_on(None):
        during = _masks()
    # threads of earlier tests may end meanwhile: every thread seen both times kept its CPUs
    assert {t: m for t, m in during.items() if t in before} == {t: m for t, m in before.items() if t in during}
    assert set(during) & set(before)


@needs_affinity
def test_a_cpu_the_os_refuses_is_one_clear_error() -> None:
    before = set(os.sched_getaffinity(0))
    with pytest.raises(AffinityError, match=r"cannot run on CPUs \[100000\]"):
        pin_process([100000])
    assert set(os.sched_getaffinity(0)) == before
