"""Requests that arrive together join the decode batch in one prefill wave when their prompts fit
the token budget, so they decode in as many steps as they have tokens and finish in one step; a
count cap (``prefill_batch``) or a small budget splits them into waves again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load

from workers.api import Finished, Job
from workers.engine.engine import Engine

TOKENS = 6


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> Any:
    return load(str(tiny_model))[0]


def _run(target: Any, **kw: Any) -> dict[str, int]:
    engine = Engine(target, eos_token_ids=(), vocab_size=260, max_batch=32, **kw)
    for seq in range(32):  # 5-token prompts: chunks of 4 (the last token starts the decode)
        engine.submit(Job(seq=seq, prompt=[5, 6, 7, 8, seq + 9], max_tokens=TOKENS))
    ends = 0
    while engine.has_work:
        ends += sum(isinstance(e, Finished) for e in engine.step())
    assert ends == 32
    return engine.counters.snapshot()


def test_arrivals_together_prefill_in_one_wave(target: Any) -> None:
    one = _run(target)
    assert one["finish_steps"] == 1 and one["peak_batch_size"] == 32
    assert one["decode_steps"] <= TOKENS  # the first token comes from the prefill


@pytest.mark.parametrize("kw", [{"prefill_batch": 8}, {"prefill_tokens": 8 * 4}])
def test_a_count_cap_or_a_small_budget_makes_waves_of_eight(target: Any, kw: dict[str, int]) -> None:
    one = _run(target)
    waves = _run(target, **kw)
    assert waves["finish_steps"] == 4
    assert waves["decode_steps"] > one["decode_steps"]
