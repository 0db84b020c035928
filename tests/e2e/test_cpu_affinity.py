"""The daemon's CPU split in real daemons: by default every thread of the front end runs on its share
of the CPUs the daemon was given and every thread of the engine process on the rest, as ``stats``
says; ``--cpu-affinity off`` leaves both on all of them; a daemon given one CPU splits nothing. Real
daemons, real processes, the tiny model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from clients import Client
from scheduler.affinity import plan_split, running_on
from tests.conftest import start_daemon
from tests.helpers.processes import _children
from tests.reference import greedy_reference

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux's per-thread affinity (read through /proc) and at least two CPUs",
)


def thread_masks(pid: int) -> set[frozenset[int]]:
    """The distinct CPU sets of process ``pid``'s threads."""
    masks = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            masks.add(frozenset(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:
            continue
    return masks


def placement(tiny_model: Path, workdir: Path, *extra: str) -> tuple[set[frozenset[int]], set[frozenset[int]], dict]:
    """A daemon's front end's and engine process's thread CPU sets, and its stats, after it served a
    request exactly."""
    d = start_daemon(tiny_model, workdir, *extra)
    try:
        (child,) = _children(d.proc.pid)
        with Client(d.address, timeout=60) as c:
            r = c.generate(tokens=[5, 6, 7], max_tokens=8)
            assert r.tokens == greedy_reference(tiny_model, [5, 6, 7], 8)[0]
            stats = c.stats()
        return thread_masks(d.proc.pid), thread_masks(child), stats
    finally:
        assert d.stop() == 0, d.log()


def test_the_front_end_and_the_engine_process_run_on_cpus_of_their_own(tiny_model: Path, tmp_path: Path) -> None:
    split = plan_split(sorted(os.sched_getaffinity(0)))
    assert split is not None
    front, engine, stats = placement(tiny_model, tmp_path)
    assert front == {frozenset(split.front_end)}
    assert engine == {frozenset(split.engine)}
    assert stats["front_end_cpus"] == list(split.front_end)
    assert stats["engine"]["loop"]["cpus"] == list(split.engine)


def test_off_leaves_both_on_every_cpu_the_daemon_was_given(tiny_model: Path, tmp_path: Path) -> None:
    given = frozenset(os.sched_getaffinity(0))
    front, engine, stats = placement(tiny_model, tmp_path, "--cpu-affinity", "off")
    assert front == engine == {given}
    assert stats["front_end_cpus"] == stats["engine"]["loop"]["cpus"] == sorted(given)


def test_a_daemon_given_one_cpu_splits_nothing(tiny_model: Path, tmp_path: Path) -> None:
    one = min(os.sched_getaffinity(0))
    with running_on((one,)):  # the daemon inherits this process's CPUs when it starts
        d = start_daemon(tiny_model, tmp_path)
    try:
        (child,) = _children(d.proc.pid)
        assert thread_masks(d.proc.pid) == thread_masks(child) == {frozenset({one})}
    finally:
        assert d.stop() == 0, d.log()
