"""The engine loop's own account (``stats.engine.loop``) on a real ``EngineThread`` and the tiny model:
its iterations, and the seconds the engine thread spent in ``emit``, the part of the daemon's cost
that lands on the engine's steps. A front end that takes 4 ms per hand-over must show up as such."""

from __future__ import annotations

import time
from pathlib import Path

from tests.helpers.engine_thread import EngineThreadRun
from workers.api import Job, Signal, Tokens

SLOW_S = 0.004


class SlowFrontEnd(EngineThreadRun):
    def _emit(self, signals: list[Signal]) -> None:
        if any(isinstance(s, Tokens) for s in signals):
            time.sleep(SLOW_S)
        super()._emit(signals)


def test_the_loop_counts_its_iterations_and_the_time_its_events_take_to_hand_over(tiny_model: Path) -> None:
    with SlowFrontEnd(tiny_model, admit_idle_window_s=0.0) as t:
        before = t.engine.snapshot()["loop"]
        t.engine.submit(Job(seq=1, prompt=[5, 6, 7], max_tokens=12))
        tokens = t.until_finished(1)
        after = t.engine.snapshot()["loop"]
    assert len(tokens) == 12
    emits = after["emit_seconds"] - before["emit_seconds"]
    assert emits >= 12 * SLOW_S  # one hand-over a step that made a token, each at least the sleep
    assert after["iterations"] - before["iterations"] >= 12
