"""``scheduler.bench.process_cpu``: a process's and a thread's CPU seconds and last CPU from ``/proc`` (Linux)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from scheduler.bench.process_cpu import cpu_seconds, daemon_processes, last_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")


def test_a_busy_process_and_its_thread_gain_cpu_and_another_thread_does_not() -> None:
    pid, idle_tid = os.getpid(), threading.get_native_id()
    before = cpu_seconds(pid)
    busy: list[float | None] = []

    def spin() -> None:
        tid = threading.get_native_id()
        start = cpu_seconds(pid, tid)
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
        after = cpu_seconds(pid, tid)
        busy.append(None if start is None or after is None else after - start)

    idle_before = cpu_seconds(pid, idle_tid)
    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()
    after, idle_after = cpu_seconds(pid), cpu_seconds(pid, idle_tid)
    assert before is not None and after is not None and idle_before is not None and idle_after is not None
    assert busy[0] is not None and busy[0] >= 0.1  # clock ticks: at least a third of its 0.3 s
    assert after - before >= busy[0] - 0.02  # the process holds its thread's CPU
    assert idle_after - idle_before < 0.1  # the waiting thread's own stays put
    assert cpu_seconds(2**22 + 12345) is None  # no such process: no answer, no exception


def test_a_process_without_children_is_a_front_end_alone() -> None:
    assert daemon_processes(os.getpid()) == {"front_end": os.getpid()}


def test_a_thread_pinned_to_a_cpu_is_last_seen_on_it() -> None:
    pid, tid = os.getpid(), threading.get_native_id()
    before = os.sched_getaffinity(0)
    target = max(before)
    os.sched_setaffinity(0, {target})
    try:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:  # runs on it since the call above
            pass
        assert last_cpu(pid, tid) == target
    finally:
        os.sched_setaffinity(0, before)
    assert last_cpu(2**22 + 12345) is None
