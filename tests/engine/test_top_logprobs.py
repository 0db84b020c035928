"""Top-k logprobs on the engine: batched, alone, paused and resumed, and bursting.

The yardstick is mlx-lm's own ``generate_step``, whose full log-probability row per token is sorted
here in numpy (most likely first, ties by lower token id): the engine must give exactly that list,
whose first entry is then the greedy token. The tiny model is bf16, so its rows tie often and the
tie rule is exercised, not assumed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from tests.helpers.engine_runs import Out, collect, run
from tests.helpers.top_logprobs import LOOPING, Top, reference
from tests.reference import load_reference, probed_bursts
from workers import kernels
from workers.api import BurstSettings, Job, Level, SamplingParams
from workers.engine import batch_step
from workers.engine.engine import Engine
from workers.engine.spec.drafters import PromptLookup
from workers.kernels import measure_widths

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [100], LOOPING]
BURSTS = BurstSettings(k=3, audit_fraction=0.0, profile_steps=0, min_rounds=10**9)


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> Any:
    model, _ = load_reference(str(tiny_model))
    measure_widths(model)
    return model


@pytest.fixture(scope="module")
def eos(tiny_model: Path) -> tuple[int, ...]:
    return tuple(load_reference(str(tiny_model))[1].eos_token_ids)


@pytest.fixture(autouse=True)
def clean_kernel_state() -> Iterator[None]:
    yield
    kernels.set_process_level(Level.WIDE)


def make_engine(target: Any, eos: tuple[int, ...], bursts: bool = False) -> Engine:
    """An engine; with ``bursts``, a prompt-lookup drafter gated by a real probe of the pairing."""
    engine = Engine(target, eos_token_ids=eos, vocab_size=260, max_batch=8)
    if bursts:
        probed_bursts(engine, target, PromptLookup(), BURSTS, "top+prompt-lookup", 260)
    return engine


def job(seq: int, prompt: list[int], n: int = 30, k: int = 5, **kw: Any) -> Job:
    return Job(seq=seq, prompt=prompt, max_tokens=n, top_logprobs=k, **kw)


# ----------------------------------------------------------------------------- the engine


def test_top_logprobs_are_the_full_rows_top_k_alone_and_batched(tiny_model: Path, target: Any, eos: Any) -> None:
    """Each job alone and all together (asking for different k, next to one asking none) give
    ``generate_step``'s row sorted: k entries, the greedy token first with exactly its logprob."""
    ks = [1, 5, 20, 3]
    jobs = [job(i, p, n=25, k=k) for i, (p, k) in enumerate(zip(PROMPTS, ks))]
    plain = Job(seq=99, prompt=[9, 10, 11], max_tokens=25)
    batched = run(make_engine(target, eos), [*jobs, plain])
    assert batched[99].lps is None and batched[99].tops is None  # asked for neither
    for j in jobs:
        alone = run(make_engine(target, eos), [j])[j.seq]
        want = reference(tiny_model, j.prompt, j.max_tokens, j.top_logprobs)
        assert alone.triple() == want
        assert batched[j.seq].triple() == want
        assert alone.tops is not None and alone.lps is not None and len(alone.tops) == len(alone.tokens) > 0
        for token, lp, top in zip(alone.tokens, alone.lps, alone.tops):
            assert len(top) == j.top_logprobs
            assert top == sorted(top, key=lambda e: (-e[1], e[0]))
            assert top[0] == (token, lp)  # greedy: the most likely token is the one emitted
    ties = sum(len({v for _, v in top}) < len(top) for top in batched[2].tops or [])
    assert ties > 0  # bf16 rows tie: the tie rule above was exercised


def test_top_logprobs_imply_logprobs_and_cost_nothing_when_not_asked(
    target: Any, eos: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, ...]] = []
    real = batch_step.top_logprobs

    def counted(rows: mx.array, k: int) -> list[Top]:
        calls.append(tuple(rows.shape))
        return real(rows, k)

    monkeypatch.setattr(batch_step, "top_logprobs", counted)
    out = run(make_engine(target, eos), [Job(seq=1, prompt=[5, 6, 7], max_tokens=12, logprobs=True)])
    assert out[1].lps is not None and out[1].tops is None and calls == []
    out = run(make_engine(target, eos), [job(2, [5, 6, 7], n=12, k=2)])  # logprobs left false
    assert out[2].lps is not None and out[2].tops is not None and len(calls) == len(out[2].tokens)
    # Several sequences asking in one step share one selection.
    calls.clear()
    out = run(make_engine(target, eos), [job(3, [5, 6, 7], n=12, k=2), job(4, [8, 9], n=12, k=4)])
    assert any(shape[0] == 2 for shape in calls)


def test_a_sampled_tokens_logprob_is_its_entry_in_the_top_k(target: Any, eos: Any) -> None:
    """Sampling among the 20 most likely tokens: each sampled token is in the top 20 by value, and
    where it is listed (a tie at the 20th place may list another), its entry is its own logprob."""
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=5)
    j = job(1, [40, 41, 42], n=40, k=20, sampling=sampling)
    out = run(make_engine(target, eos), [j])[1]
    assert out.lps is not None and out.tops is not None
    listed = 0
    for token, lp, top in zip(out.tokens, out.lps, out.tops):
        assert lp >= top[-1][1]
        if token in dict(top):
            listed += 1
            assert dict(top)[token] == lp
    assert listed > len(out.tokens) // 2
    assert any(top[0][0] != token for token, top in zip(out.tokens, out.tops))  # really sampled


def test_a_paused_and_resumed_sequence_keeps_its_top_logprobs(tiny_model: Path, target: Any, eos: Any) -> None:
    """The pending token's top logprobs are taken with it out of the batch and emitted on resume."""
    j, other = job(1, [5, 6, 7], n=30, k=6), job(2, [40, 41], n=30, k=2)
    want = run(make_engine(target, eos), [j, other])
    engine = make_engine(target, eos)
    out: dict[int, Out] = {}
    for x in (j, other):
        engine.submit(x)
    while len(out.get(1, Out()).tokens) < 8:
        collect(engine.step(), out)
    engine.pause(1)
    for _ in range(5):
        collect(engine.step(), out)
    collect(engine.resume(1), out)
    while engine.has_work:
        collect(engine.step(), out)
    assert {s: o.triple() for s, o in out.items()} == {s: o.triple() for s, o in want.items()}
    assert out[1].triple() == reference(tiny_model, j.prompt, j.max_tokens, j.top_logprobs)


def test_bursts_give_the_same_top_logprobs_as_classic_decode(target: Any, eos: Any) -> None:
    """A prompt-lookup burst's tokens (from its verify rows) carry byte for byte what classic decode
    gives: alone, interrupted by an arrival (the pending token goes back into the batch), paused."""
    first = job(1, LOOPING, n=60, k=5)
    later = job(2, [5, 6, 7], n=10, k=3)
    want = {s: o.exact() for s, o in run(make_engine(target, eos), [first, later]).items()}
    assert len(want[1][2]) == len(want[1][0]) > 0

    engine = make_engine(target, eos, bursts=True)
    alone = run(engine, [first])[1]
    assert engine.bursts.accepted > 0 and "burst" in alone.modes
    assert alone.exact() == want[1]

    engine = make_engine(target, eos, bursts=True)
    got = run(engine, [first], arrivals={8: [later]})
    assert engine.bursts.interrupted >= 1 and engine.bursts.accepted > 0
    assert {s: o.exact() for s, o in got.items()} == want

    engine = make_engine(target, eos, bursts=True)
    out: dict[int, Out] = {}
    engine.submit(first)
    while engine.bursts.rounds < 2:
        collect(engine.step(), out)
    assert engine._burst is not None
    engine.pause(1)
    collect(engine.resume(1), out)
    while engine.has_work:
        collect(engine.step(), out)
    assert out[1].exact() == want[1]
