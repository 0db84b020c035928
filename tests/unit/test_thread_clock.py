"""``workers.engine.thread_clock``: the calling thread's CPU seconds, not its process's."""

from __future__ import annotations

import threading
import time

from workers.engine import thread_clock


def _spin(seconds: float, used: list[float]) -> None:
    start = thread_clock.read()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    used.append(thread_clock.read().cpu_seconds - start.cpu_seconds)


def test_another_thread_s_work_is_not_counted_and_a_wait_costs_nothing() -> None:
    used: list[float] = []
    before = thread_clock.read()
    spinner = threading.Thread(target=_spin, args=(0.3, used))
    spinner.start()
    spinner.join()  # this thread waits: its CPU stays put while the other one runs
    after = thread_clock.read()
    assert after.cpu_seconds - before.cpu_seconds < 0.1
    assert used and used[0] > 0  # the spinner's own reading saw its work
    assert after.preemptions >= before.preemptions >= 0
