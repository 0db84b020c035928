"""The penalties' windows, as OpenAI and vLLM define them: presence and frequency over every token
emitted so far (the prompt does not count), repetition over the prompt and every emitted token, none
forgotten however long ago it came. Checked against the formulas written out in NumPy on a synthetic
history longer than mlx-lm's default 20-token context, and as pure functions of (tokens, logits),
which a burst's verify relies on when it calls them over extended histories."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tests.reference import penalized_reference
from workers.api import Job, SamplingParams, Tokens
from workers.engine.logits_controls import processors_for

V = 64
PROMPT = [3, 4, 5, 60, 61]  # 60 and 61 only in the prompt
OLD, RECENT = 10, 11  # OLD emitted twice, first of all (over 20 tokens ago); RECENT once, last
OUTPUT = [OLD, OLD] + [20 + i % 25 for i in range(30)] + [RECENT]
HISTORY = PROMPT + OUTPUT


def logits_row() -> np.ndarray:
    """Positive and negative logits, distinct everywhere."""
    return np.linspace(-3.0, 3.0, V, dtype=np.float32)[::-1].copy()


def apply(params: SamplingParams, history: list[int], logits: np.ndarray) -> np.ndarray:
    out = mx.array(logits[None])
    for p in processors_for(params, len(PROMPT), stops=()):
        out = p(mx.array(history, dtype=mx.int32), out)
    return np.array(out[0])


def openai_penalties(logits: np.ndarray, output: list[int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's formula: ``logit - presence * (count > 0) - frequency * count`` over the output."""
    want = logits.copy()
    for token, count in Counter(output).items():
        want[token] -= presence + frequency * count
    return want


def vllm_repetition(logits: np.ndarray, seen: list[int], penalty: float) -> np.ndarray:
    """vLLM's: each token of the prompt or the output divides a positive logit, multiplies a negative one."""
    want = logits.copy()
    for token in set(seen):
        want[token] = want[token] / penalty if want[token] > 0 else want[token] * penalty
    return want


def test_presence_and_frequency_count_every_emitted_token_and_not_the_prompt() -> None:
    assert len(OUTPUT) > 20 and OUTPUT.index(OLD) == 0
    logits = logits_row()
    for presence, frequency in ((1.5, 0.0), (0.0, 0.7), (-0.5, 0.4)):
        got = apply(SamplingParams(presence_penalty=presence, frequency_penalty=frequency), HISTORY, logits)
        want = openai_penalties(logits, OUTPUT, presence, frequency)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert abs(got[OLD] - logits[OLD]) > 0.2  # over 30 tokens ago: still penalized (twice for frequency)
        assert got[60] == logits[60] and got[61] == logits[61]  # in the prompt only: untouched


def test_nothing_emitted_yet_leaves_the_logits_alone_though_the_prompt_repeats() -> None:
    logits = logits_row()
    got = apply(SamplingParams(presence_penalty=1.5, frequency_penalty=0.7), PROMPT, logits)
    np.testing.assert_array_equal(got, logits)


def test_repetition_counts_the_whole_prompt_and_output() -> None:
    logits = logits_row()
    assert logits[60] < 0 < logits[3]  # prompt tokens, over 20 tokens back, on both signs
    got = apply(SamplingParams(repetition_penalty=1.3), HISTORY, logits)
    want = vllm_repetition(logits, HISTORY, 1.3)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got[3] != logits[3] and got[60] != logits[60] and got[OLD] != logits[OLD]
    assert got[2] == logits[2]  # never seen


def test_the_processors_are_pure_functions_of_tokens_and_logits() -> None:
    """The verify calls them over histories extended by drafts, in any order: each answer depends on
    its own (tokens, logits) only."""
    params = SamplingParams(presence_penalty=0.9, frequency_penalty=0.4, repetition_penalty=1.2)
    logits = logits_row()
    first = [apply(params, HISTORY[:n], logits) for n in range(len(PROMPT), len(HISTORY) + 1)]
    again = [apply(params, HISTORY[:n], logits) for n in reversed(range(len(PROMPT), len(HISTORY) + 1))]
    for a, b in zip(first, reversed(again)):
        np.testing.assert_array_equal(a, b)


def test_a_paused_sequence_put_back_keeps_its_penalties_over_its_whole_history(tiny_model: Path) -> None:
    """Put back after a pause, the sequence re-enters the batch with its history as the tokens in
    its cache: the penalties still count the output from its first token, so a token emitted early
    and penalized stays out, and the output equals mlx-lm's."""
    from mlx_lm import load

    from workers.engine.engine import Engine

    prompt = [7, 7, 7, 7, 8, 8, 8, 8]
    want = penalized_reference(tiny_model, prompt, 60, frequency_penalty=0.7)
    assert 180 in want[:6] and 180 not in want[20:]  # 180 emitted early, and kept out for good
    engine = Engine(load(str(tiny_model))[0], eos_token_ids=(0,), vocab_size=260)
    engine.submit(Job(seq=1, prompt=prompt, max_tokens=60, sampling=SamplingParams(frequency_penalty=0.7)))
    got: list[int] = []

    def take(events: list[Any]) -> None:
        got.extend(t for e in events if isinstance(e, Tokens) for t in e.tokens)

    while len(got) < 12:
        take(engine.step())
    assert engine.pause(1) == [] and engine.paused == 1 and not engine.has_work
    take(engine.resume(1))  # its pending token, and back into the batch
    while engine.has_work:
        take(engine.step())
    assert got == want
