"""A machine measured slow prefills a big wave in more, shorter steps, each within the step's target
time, and every sequence's tokens and logprobs equal the unbounded run's byte for byte.

The engine's clock seam (``PrefillPace.clock``) is given a clock that advances a fixed time per row
the model forwards: a machine exactly that slow, with no sleeps and no real timings."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load

from scheduler.cli import build_parser
from scheduler.cli.serve import engine_settings
from scheduler.engine_watchdog import STEP_TARGET_SHARE
from workers.api import Finished, Job, Tokens
from workers.engine.engine import Engine
from workers.engine.prefill_pace import MIN_STEP_TOKENS, PrefillPace, forwarded_rows
from workers.engine.startup import warm_up

PROMPTS = 8
PROMPT_TOKENS = 240
#: Simulated seconds per forwarded row, and the step target: at most 100 rows a step.
PER_ROW_S = 1e-3
TARGET_S = 0.1


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> Any:
    return load(str(tiny_model))[0]


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 256) for _ in range(PROMPT_TOKENS + 17 * i)] for i in range(PROMPTS)]


def _run(target: Any, slow: bool) -> tuple[dict[int, list[tuple[int, float]]], list[int], int]:
    """Every sequence's (token, logprob) pairs, the rows each served step forwarded, and its prefill steps."""
    engine = Engine(target, eos_token_ids=(), vocab_size=260, max_batch=PROMPTS, step_target_s=TARGET_S if slow else 0)
    if slow:
        engine.pace.clock = lambda: forwarded_rows(engine.ledger) * PER_ROW_S
    warm_up(engine)  # as the daemon does: the first measurement comes from it
    engine.reset_counters()
    for seq, prompt in enumerate(_prompts()):
        engine.submit(Job(seq=seq, prompt=prompt, max_tokens=6, logprobs=True))
    out: dict[int, list[tuple[int, float]]] = {seq: [] for seq in range(PROMPTS)}
    rows: list[int] = []
    ends = 0
    while engine.has_work:
        before = forwarded_rows(engine.ledger)
        for e in engine.step():
            if isinstance(e, Tokens):
                assert e.logprobs is not None
                out[e.seq] += list(zip(e.tokens, e.logprobs))
            ends += isinstance(e, Finished)
        rows.append(forwarded_rows(engine.ledger) - before)
    assert ends == PROMPTS
    return out, rows, engine.counters.prefill_steps


def test_a_slow_machine_prefills_in_steps_within_the_target_and_outputs_are_byte_identical(target: Any) -> None:
    fast, fast_rows, fast_prefills = _run(target, slow=False)
    slow, slow_rows, slow_prefills = _run(target, slow=True)
    total = sum(len(p) for p in _prompts())
    assert max(fast_rows) * PER_ROW_S > 10 * TARGET_S  # unbounded: one step carries the whole wave
    assert all(r * PER_ROW_S <= TARGET_S for r in slow_rows), slow_rows  # every step within the target
    assert slow_prefills >= total * PER_ROW_S / TARGET_S > fast_prefills
    assert slow == fast  # tokens and logprobs, byte for byte


def test_the_budget_is_within_its_floor_and_prefill_tokens() -> None:
    pace = PrefillPace(TARGET_S)
    assert pace.budget(4096, 0) == 4096  # nothing measured yet
    pace.record(10, 10 * PER_ROW_S)
    assert pace.budget(4096, 8) == int(TARGET_S / PER_ROW_S) - 8  # what fits beside the decode rows
    assert pace.budget(50, 0) == 50  # never above prefill_tokens
    pace.record(1, 1.0)  # a step far slower: the largest recent figure rules
    assert pace.budget(4096, 0) == MIN_STEP_TOKENS  # never below the floor
    pace.record(MIN_STEP_TOKENS, MIN_STEP_TOKENS * PER_ROW_S / 2)  # once a step of many rows is measured,
    assert pace.budget(4096, 0) == 2 * int(TARGET_S / PER_ROW_S)  # the tiny steps' fixed costs are not read
    assert PrefillPace(0.0).budget(4096, 0) == 4096  # no target: no time bound


def test_tokens_within_a_time_are_bounded_by_their_floor_and_cap() -> None:
    """``within``: the tokens a forward may carry to last a given time (start-up units' chunks)."""
    pace = PrefillPace(TARGET_S)
    assert pace.within(0.5, 2048) == 2048  # nothing measured yet
    pace.record(100, 100 * PER_ROW_S)
    fits = int(0.5 / pace.seconds_per_row())  # type: ignore[operator]
    assert abs(fits - 0.5 / PER_ROW_S) <= 1 and pace.within(0.5, 2048) == fits
    assert pace.within(0.5, 8192, least=10 * fits) == 10 * fits  # the floor over the time
    assert pace.within(0.5, 3) == 3
    assert pace.within(0.0, 2048) == 2048 and PrefillPace(0.0).within(0.5, 2048) == 2048  # no target


@pytest.mark.parametrize(("timeout", "target_s"), [("40", 40 * STEP_TARGET_SHARE), ("0", 0.0)])
def test_the_daemon_sizes_steps_from_its_engine_timeout(timeout: str, target_s: float) -> None:
    """A step target within the watchdog's limit; none where the watchdog is off."""
    args = build_parser().parse_args(["serve", "--engine-timeout", timeout])
    assert engine_settings(args).step_target_s == target_s
