"""Sampling settings through the engine on the tiny model: settings that leave only the most likely
token generate exactly the greedy text, at every extreme the protocol accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load

from workers.api import Finished, Job, SamplingParams, Tokens
from workers.engine.engine import Engine


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> Any:
    model = load(str(tiny_model))[0]
    return model


def _generate(target: Any, sampling: SamplingParams) -> list[int]:
    engine = Engine(target, eos_token_ids=(0,), vocab_size=260)
    engine.submit(Job(seq=1, prompt=[5, 6, 7, 8], max_tokens=24, sampling=sampling))
    tokens: list[int] = []
    while engine.has_work:
        for e in engine.step():
            if isinstance(e, Tokens):
                tokens += e.tokens
            elif isinstance(e, Finished):
                assert e.error_code is None
    return tokens


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1e-38, seed=1),
        SamplingParams(temperature=1e-39, seed=1),
        SamplingParams(temperature=5e-324, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-300, seed=1),
        SamplingParams(temperature=100.0, top_p=5e-324, seed=1),
        SamplingParams(temperature=100.0, top_k=1, seed=1),
        SamplingParams(temperature=100.0, min_p=1.0, seed=1),
    ],
    ids=["t=1e-38", "t=1e-39", "t=5e-324", "top_p=1e-300", "top_p=5e-324", "top_k=1", "min_p=1"],
)
def test_settings_that_leave_only_the_top_token_generate_the_greedy_text(target: Any, sampling: SamplingParams) -> None:
    assert _generate(target, sampling) == _generate(target, SamplingParams())
