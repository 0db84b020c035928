"""The engine's step counters that say how a batch's arrivals and ends were spread: steps that ran a
prefill chunk and steps in which a sequence finished (real ``Engine``, tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load

from workers.api import Finished, Job
from workers.engine.engine import Engine


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> Any:
    return load(str(tiny_model))[0]


def drain(engine: Engine) -> list[Finished]:
    ends = []
    while engine.has_work:
        ends += [e for e in engine.step() if isinstance(e, Finished)]
    return ends


def test_arrivals_together_prefill_together_and_equal_budgets_end_together(target: Any) -> None:
    engine = Engine(target, eos_token_ids=(), vocab_size=260)
    for seq, budget in ((1, 2), (2, 2), (3, 5)):
        engine.submit(Job(seq=seq, prompt=[5, 6, 7, seq], max_tokens=budget))
    assert len(drain(engine)) == 3
    wave = engine.counters.prefill_steps  # one wave's prefill steps (mlx-lm's own split of a prompt)
    assert wave >= 1 and engine.counters.finish_steps == 2

    for seq in (4, 5):  # two more waves, one sequence each
        engine.submit(Job(seq=seq, prompt=[9, 9, 9, seq], max_tokens=3))
        drain(engine)
    snap = engine.counters.snapshot()
    assert (snap["prefill_steps"], snap["finish_steps"]) == (3 * wave, 4)


def test_warm_up_runs_a_lone_sequence_and_a_padded_batch(target: Any) -> None:
    """The daemon's warm-up (before it announces itself ready) reaches the batched path too: two
    prompts of different lengths in one wave, decoded together, one finishing first."""
    from workers.engine.startup import warm_up

    engine = Engine(target, eos_token_ids=(), vocab_size=260)
    warm_up(engine)
    snap = engine.counters.snapshot()
    assert not engine.has_work and snap["peak_batch_size"] == 2
    assert snap["finish_steps"] == 3  # the lone one, then the two ends a step apart


def test_the_engine_thread_s_cpu_inside_its_steps(target: Any) -> None:
    """Each step adds the engine thread's own CPU seconds (never more than the steps' wall seconds: one
    thread cannot run longer than it exists) and its involuntary switches (counted on Linux)."""
    from workers.engine import thread_clock

    engine = Engine(target, eos_token_ids=(), vocab_size=260)
    engine.submit(Job(seq=1, prompt=[5, 6, 7, 8], max_tokens=6))
    drain(engine)
    snap = engine.counters.snapshot()
    assert 0 < snap["step_cpu_seconds"] <= snap["step_seconds"] + 1e-3
    assert isinstance(snap["step_preemptions"], int) and snap["step_preemptions"] >= 0
    assert thread_clock.counts_preemptions() == hasattr(__import__("resource"), "RUSAGE_THREAD")
