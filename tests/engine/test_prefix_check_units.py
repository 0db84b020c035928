"""The prefix cache's start-up check as units between engine steps (``warm_vs_cold_steps``): a draw
is many units of one forward each (a prefill chunk or one token), each evaluated before it ends, so a
request arriving mid-check waits for one forward; the draws' outcomes and the verdict are the bytes of
the check run as one call per draw, also with other forwards of the same model between the units.

A tiny gemma3 with sliding-window layers on the CPU gives every kind of outcome: exact draws, draws
whose warm output differs from the cold one, and an entry that cannot be trimmed."""

from __future__ import annotations

import copy
import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from tests.helpers.units import Counted, run_units
from workers.engine import prefix_check
from workers.engine.prefix_check import DECODE_STEPS, ReuseVerdict, decide, make_draws, warm_vs_cold
from workers.kernels import as_int, merge_caches
from workers.models.synthetic import BYTE_VOCAB, build_model, gemma3_config

STEP = 64
WINDOW = 64
CONTEXT = 4096


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(gemma3_config(window=WINDOW), seed=3)


# --------------------------------------------------------------------------- the check as one call a draw


def _feed_whole(model: Any, cache: list[Any], tokens: list[int], step: int, singles: int) -> mx.array:
    split = len(tokens) - singles
    for i in range(0, split, step):
        model(mx.array([tokens[i : min(i + step, split)]]), cache=cache)
        mx.eval([c.state for c in cache])
    logits = mx.array(0)
    for t in tokens[split:]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        mx.eval(logits)
    return logits


def _continue_whole(
    model: Any, cache: list[Any], first: mx.array, tokens: list[int] | None
) -> tuple[list[mx.array], list[int]]:
    rows, fed = [first], []
    for i in range(DECODE_STEPS):
        t = as_int(mx.argmax(rows[-1])) if tokens is None else tokens[i]
        fed.append(t)
        rows.append(model(mx.array([[t]]), cache=cache)[0, -1])
        mx.eval(rows[-1])
    return rows, fed


def _draw_whole(model: Any, d: prefix_check.Draw, step: int, vocab: int, rng: random.Random) -> None:
    """One draw in one call, as the check ran before its draws were split into units."""
    prompt = [rng.randrange(vocab) for _ in range(d.prompt)]
    entry = prompt[: d.cached] + [rng.randrange(vocab) for _ in range(d.trimmed)]
    batch = merge_caches([make_prompt_cache(model)])
    _feed_whole(model, batch, entry, step, d.decoded + 1)
    stored = [c.extract(0) for c in batch]
    if d.trimmed and not can_trim_prompt_cache(stored):
        d.skipped = "entry not trimmable"
        return
    warm_cache = copy.deepcopy(stored)
    trim_prompt_cache(warm_cache, d.trimmed)
    cold_cache = merge_caches([make_prompt_cache(model)])
    cold, fed = _continue_whole(model, cold_cache, _feed_whole(model, cold_cache, prompt, step, 1), None)
    warm_batch = merge_caches([warm_cache])
    warm, _ = _continue_whole(model, warm_batch, _feed_whole(model, warm_batch, prompt[d.cached :], step, 1), fed)
    d.differing_bytes, d.total_bytes = prefix_check._differing(mx.stack(cold), mx.stack(warm))


def _whole(model: Any, seed: int) -> ReuseVerdict:
    rng = random.Random(seed)
    draws = make_draws(STEP, WINDOW, CONTEXT)
    for d in draws:
        _draw_whole(model, d, STEP, BYTE_VOCAB, rng)
    return decide(draws, WINDOW, 0.0)


def _outcome(v: ReuseVerdict) -> dict[str, Any]:
    return {**v.as_dict(), "seconds": None}


# --------------------------------------------------------------------------- units


@pytest.mark.parametrize("seed", [0, 5])
def test_the_units_give_the_verdict_and_draws_of_the_check_run_whole(model: Any, seed: int) -> None:
    """Also with the same model serving other forwards between the units, as the engine does."""
    whole = _whole(model, seed)
    assert whole.window_only and any(d.differing_bytes for d in whole.draws)  # a check with every kind
    assert any(d.skipped for d in whole.draws) and any(d.total_bytes and not d.differing_bytes for d in whole.draws)
    assert _outcome(
        warm_vs_cold(model, prefill_step=STEP, vocab_size=BYTE_VOCAB, window=WINDOW, context=CONTEXT, seed=seed)
    ) == _outcome(whole)

    serving = make_prompt_cache(model)

    def serve() -> None:
        mx.eval(model(mx.array([[7, 8, 9]]), cache=serving))

    labels, stepped = run_units(prefix_check.warm_vs_cold_steps(model, STEP, BYTE_VOCAB, WINDOW, CONTEXT, seed), serve)
    assert _outcome(stepped) == _outcome(whole)
    assert len(labels) > 2 * len(whole.draws)


def test_a_draw_is_many_units_of_one_evaluated_forward_each(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every unit runs at most one forward of at most one prefill chunk and evaluates it before it
    ends (an ``mx.eval`` after the forward); each draw that ran is as many units as forwards."""
    events: list[tuple[str, int]] = []
    real_eval = mx.eval

    def noted_eval(*args: Any) -> None:
        events.append(("eval", 0))
        real_eval(*args)

    monkeypatch.setattr(mx, "eval", noted_eval)
    units: list[list[tuple[str, int]]] = []

    def cut() -> None:
        units.append(events[:])
        events.clear()

    steps = prefix_check.warm_vs_cold_steps(Counted(model, events), STEP, BYTE_VOCAB, WINDOW, CONTEXT)
    labels, verdict = run_units(steps, cut)
    assert not [e for e in events if e[0] == "forward"]  # the verdict's call runs no forward
    assert len(units) == len(labels)
    for label, unit in zip(labels, units, strict=True):
        forwards = [i for i, e in enumerate(unit) if e[0] == "forward"]
        assert len(forwards) <= 1, (label, unit)
        for i in forwards:
            assert 1 <= unit[i][1] <= STEP, (label, unit)
            assert ("eval", 0) in unit[i + 1 :], f"unit {label!r} ends before its forward is evaluated"
    per_draw: dict[str, int] = {}
    for label, unit in zip(labels, units, strict=True):
        draw = " ".join(label.split()[:2])
        per_draw[draw] = per_draw.get(draw, 0) + 1
        assert any(e[0] == "forward" for e in unit), f"unit {label!r} ran no forward"
    assert len(per_draw) == len(verdict.draws)
    for (draw, count), d in zip(per_draw.items(), verdict.draws, strict=True):
        assert count > 1, f"{draw} ran as one unit"
        assert count == _forwards(d), draw


def _forwards(d: prefix_check.Draw) -> int:
    """The forwards a draw runs: its entry's chunks and single tokens, then cold and warm prefills
    (chunks and the last token alone) and their decode steps."""

    def chunks(n: int) -> int:
        return -(-n // STEP)

    entry = chunks(d.cached + d.trimmed - d.decoded - 1) + d.decoded + 1
    if d.skipped:
        return entry
    return entry + chunks(d.prompt - 1) + chunks(d.prompt - d.cached - 1) + 2 * (1 + DECODE_STEPS)
