"""The probe as units between engine steps: every draw of the ladder, every pin-cost pair and the
verify warm-up run a forward per unit (a prefill chunk, one classic decode step, one block, one
timed step), each evaluated before its unit ends, so a request (or a stop) arriving mid-draw waits
for one forward. The verdicts, the draws' results and the logits are the bytes of the probe run a
draw per unit (kept here as the reference), also with the model serving other forwards between the
units; and what serves between them runs at the serving level, never at a probe's pin.

The divergence calibration exists for is injected at ``workers.kernels.seam.divergence_seam`` (as
``test_ladder`` does): projections on more than 2 real-like rows differ, so wide fails and narrow
is exact after calibration narrows the widths."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import workers.kernels.seam
from tests.helpers.units import Counted, run_units
from tests.reference import load_measured, perturb
from workers import kernels
from workers.api import Level, ProbePolicy
from workers.exact import draws as draws_mod
from workers.exact.draws import (
    MAX_CALIBRATION_PASSES,
    Draw,
    MakeCache,
    block_steps,
    chain_level,
    chain_steps,
    compare,
    layout_stable,
    make_draws,
)
from workers.exact.ladder import ladder_steps
from workers.exact.pin_cost import REPS, pin_cost_steps
from workers.exact.pins import CountedModel, PinLedger
from workers.exact.probe import probe_steps
from workers.exact.results import DrawResult, LevelResult
from workers.exact.verify_warmup import warm_steps
from workers.kernels import as_int, calibrate, capturing, current_level, in_scoped_pin, mlxlm, scoped, wrap_caches
from workers.models.synthetic import PRESETS, write_model

VOCAB = 260
K = 3
REAL_RMS = 0.75

pytestmark = pytest.mark.usefixtures("clean_kernel_state")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("units") / "tiny-llama", PRESETS["tiny-llama"], seed=5)


def _inject_narrowing_divergence(model: Any) -> None:
    """Projections on more than 2 real-like rows differ from one-row calls (load-time widths, measured
    on random rows, stay 16): wide is inexact, narrow exact once calibration narrows to 2."""

    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        call = workers.kernels.seam.seam_call
        assert call is not None
        x = call.inputs.astype(mx.float32)
        real = bool((mx.sqrt(mx.mean(x * x)) > REAL_RMS).item())
        return perturb(out) if kind == "projection" and rows > 2 and real else out

    workers.kernels.seam.divergence_seam = seam
    kernels.measure_widths(model)


# --------------------------------------------------------------------------- the probe a draw per unit (reference)


def _prefill_whole(model: Any, cache: list[Any], tokens: list[int], step: int = 2048) -> None:
    for i in range(0, len(tokens), step):
        model(mx.array([tokens[i : i + step]]), cache=cache)
        mx.eval([c.state for c in cache])


def _chain_whole(model: Any, make_cache: MakeCache, draw: Draw, width: int, level: Level) -> tuple[mx.array, list[int]]:
    single = make_cache()
    _prefill_whole(model, single, draw.prompt[:-1])
    cache = mlxlm.merge_caches([single])
    token = draw.prompt[-1]
    fed, rows = [], []
    with scoped(level):
        for _ in range(width):
            fed.append(token)
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
            mx.eval(logits)
            rows.append(logits)
            token = as_int(mx.argmax(logits))
    return mx.stack(rows), fed


def _block_whole(
    model: Any, make_cache: MakeCache, draw: Draw, tokens: list[int], level: Level, calls: list[Any] | None = None
) -> mx.array:
    cache = make_cache()
    _prefill_whole(model, cache, draw.prompt[:-1])
    with scoped(level), capturing(calls) if calls is not None else nullcontext():
        layers = wrap_caches(cache) if level.per_query else cache
        logits = model(mx.array([tokens]), cache=layers)[0]
        mx.eval(logits)
    return logits


def _calibrated_whole(
    model: Any, make_cache: MakeCache, draw: Draw, tokens: list[int], level: Level
) -> tuple[mx.array, dict[int, tuple[int, int]]]:
    narrowed: dict[int, tuple[int, int]] = {}
    for _ in range(MAX_CALIBRATION_PASSES):
        calls: list[Any] = []
        block = _block_whole(model, make_cache, draw, tokens, level, calls)
        changed = calibrate(calls)
        if not changed:
            return block, narrowed
        for mid, (before, after) in changed.items():
            narrowed[mid] = (narrowed.get(mid, (before, after))[0], after)
    return _block_whole(model, make_cache, draw, tokens, level), narrowed


def _ladder_whole(
    model: Any, make_cache: MakeCache, draws: list[Draw], k: int, levels: tuple[Level, ...]
) -> Generator[str, None, tuple[Level | None, bool, str, list[LevelResult]]]:
    """The ladder as it ran a draw per unit (default policy; the branches these tests reach)."""
    kernels.install()
    make_cache = layout_stable(make_cache)
    kernels.reset_widths(model)
    paths = {id(m): path for path, m in model.named_modules()}
    width = k + 1
    baselines: dict[tuple[str, Level], tuple[mx.array, list[int], int]] = {}
    results: list[LevelResult] = []
    for level in levels:
        lr = LevelResult(level.value, exact=True)
        queue, ran = list(draws), set[str]()
        while queue:
            draw = queue.pop(0)
            yield f"{level.value}: {draw.name}" + (" (again, with narrowed widths)" if draw.name in ran else "")
            ran.add(draw.name)
            tic = time.perf_counter()
            base = (draw.name, chain_level(level))
            if base not in baselines:
                chain1, fed = _chain_whole(model, make_cache, draw, width, base[1])
                chain2, _ = _chain_whole(model, make_cache, draw, width, base[1])
                baselines[base] = (chain1, fed, compare(chain1, chain2)[1])
            chain, fed, classic_var = baselines[base]
            narrowed: dict[int, tuple[int, int]] = {}
            if level.calibrated:
                block, narrowed = _calibrated_whole(model, make_cache, draw, fed, level)
            else:
                block = _block_whole(model, make_cache, draw, fed, level)
            for mid, (before, after) in narrowed.items():
                path = paths.get(mid, str(mid))
                lr.narrowed[path] = [lr.narrowed.get(path, [before])[0], after]
            first, diff, total = compare(chain, block)
            dr = DrawResult(
                draw.name,
                len(draw.prompt),
                exact=diff == 0,
                first_position=first,
                differing_bytes=diff,
                total_bytes=total,
                chain_vs_chain_bytes=classic_var,
                narrowed=len(narrowed),
            )
            assert not classic_var
            dr.seconds = time.perf_counter() - tic
            if narrowed and lr.draws and dr.exact:
                lr.draws, queue = [], list(draws)
                continue
            lr.draws.append(dr)
            if not dr.exact:
                lr.exact = False
                break
        results.append(lr)
        if lr.exact:
            return level, True, "exact", results
    return None, False, "declined", results


# --------------------------------------------------------------------------- helpers


def _results(results: list[LevelResult]) -> list[dict[str, Any]]:
    """The ladder's results without their seconds."""
    out = []
    for lr in results:
        d = asdict(lr)
        d["seconds"] = None
        for dr in d["draws"]:
            dr["seconds"] = None
        out.append(d)
    return out


def _server(model: Any) -> Callable[[], None]:
    """A forward of another sequence on the same model, as the engine serves between units."""
    cache = make_prompt_cache(model)

    def serve() -> None:
        mx.eval(model(mx.array([[7, 8, 9]]), cache=cache))

    return serve


# --------------------------------------------------------------------------- same bytes


def test_chain_and_block_units_give_the_bytes_of_the_whole_draw(model_path: Path) -> None:
    """Also with other forwards of the model served between the units, at a rung that pins the chain
    (padded) and at one that does not, on a short draw and the draw past the capacity step."""
    model = load_measured(model_path)
    make_cache = layout_stable(lambda: make_prompt_cache(model))
    serve = _server(model)
    for draw in make_draws(K, VOCAB, 4096, None)[2:4]:
        for level in (Level.WIDE, Level.PADDED, Level.PER_QUERY):
            whole, fed = _chain_whole(model, make_cache, draw, K + 1, level)
            labels, (stepped, stepped_fed) = run_units(chain_steps(model, make_cache, draw, K + 1, level), serve)
            assert stepped_fed == fed and compare(whole, stepped)[1] == 0, (draw.name, level)
            assert len(labels) == K + 1 + 1  # the prefill's one chunk, then each decode step
            block = _block_whole(model, make_cache, draw, fed, level)
            labels, stepped = run_units(block_steps(model, make_cache, draw, fed, level), serve)
            assert compare(block, stepped)[1] == 0 and len(labels) == 2, (draw.name, level)


def test_the_ladder_in_units_reaches_the_verdict_and_results_of_the_ladder_a_draw_per_unit(model_path: Path) -> None:
    """Injected divergence: wide fails on its first draw, narrow calibrates its widths and is exact.
    Run a forward per unit with forwards served between the units, the ladder gives the same rungs,
    draws, byte counts, narrowed widths and verdict, and the widths it leaves are the same."""
    model = load_measured(model_path)
    _inject_narrowing_divergence(model)
    draws = make_draws(K, VOCAB, 4096, None)[:2]
    levels = (Level.WIDE, Level.NARROW)
    make_cache = lambda: make_prompt_cache(model)  # noqa: E731

    labels_whole, (level, exact, _, results) = run_units(_ladder_whole(model, make_cache, draws, K, levels))
    widths_whole = kernels.widths_by_path(model)
    assert (level, exact) == (Level.NARROW, True)
    assert [(lr.level, lr.exact) for lr in results] == [("wide", False), ("narrow", True)]
    assert results[1].narrowed and results[0].draws[0].differing_bytes > 0

    labels, (level2, exact2, _, results2) = run_units(
        ladder_steps(model, make_cache, draws, K, levels=levels), _server(model)
    )
    assert (level2, exact2) == (level, exact)
    assert _results(results2) == _results(results)
    assert kernels.widths_by_path(model) == widths_whole
    # The draws' labels are the ones the ladder yielded a draw per unit, in order, each before its draw.
    assert [label for label in labels if " / " not in label] == labels_whole
    assert len(labels) > 4 * len(labels_whole)


# --------------------------------------------------------------------------- a forward a unit


def test_every_unit_runs_one_forward_at_most_and_evaluates_it(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole probe (ladder with calibration, pin cost, warm-up): a unit runs at most one forward,
    an ``mx.eval`` follows it within the unit, a draw is many units, and the forwards are those of the
    probe a draw per unit (the pin ledger's counts, per level and purpose, match)."""
    model = load_measured(model_path)
    _inject_narrowing_divergence(model)
    events: list[tuple[str, int]] = []
    real_eval = mx.eval

    def noted_eval(*args: Any) -> None:
        events.append(("eval", 0))
        real_eval(*args)

    monkeypatch.setattr(mx, "eval", noted_eval)
    draws = make_draws(K, VOCAB, 4096, None)[:2]
    ledger = PinLedger()
    counted = Counted(CountedModel(model, ledger), events)
    steps = probe_steps(
        counted, lambda: make_prompt_cache(model), {"t": "units"}, draws, K, warm=[2, 3, 4], max_batch=8
    )
    units: list[list[tuple[str, int]]] = []

    def cut() -> None:
        units.append(events[:])
        events.clear()

    labels, verdict = run_units(steps, cut)
    assert verdict.level == "narrow" and verdict.exact, verdict.reason
    assert verdict.pin_cost and [r.batch for r in verdict.pin_cost][-1] == 8
    assert len(units) == len(labels)
    for label, unit in zip(labels, units, strict=True):
        forwards = [i for i, e in enumerate(unit) if e[0] == "forward"]
        assert len(forwards) <= 1, (label, unit)
        for i in forwards:
            assert ("eval", 0) in unit[i + 1 :], f"unit {label!r} ends before its forward is evaluated"
    assert not [e for e in events if e[0] == "forward"]  # the verdict's own unit runs none

    # Each ladder draw (the units from its label to the next) and each pin-cost pair: many units.
    per_draw: dict[str, int] = {}
    for label, unit in zip(labels, units, strict=True):
        head = label.split(" / ")[0]
        if any(e[0] == "forward" for e in unit):
            per_draw[head] = per_draw.get(head, 0) + 1
    ladder = [h for h in per_draw if h.startswith(("wide: ", "narrow: "))]
    assert len(ladder) == 1 + len(draws)  # wide fails on its first draw, narrow runs every one
    assert all(per_draw[h] > 1 for h in ladder)
    for h in (h for h in per_draw if h.startswith("pin cost at")):
        assert per_draw[h] == 1 + 2 * (REPS + 1), h  # the prefill, then each timed step
    assert [label for label in labels if label.startswith("warm-up")] == [
        f"warm-up: verify of {n} rows at narrow" for n in (2, 3, 4)
    ]

    # The same forwards as the probe a draw per unit: count them with the reference.
    kernels.reset_widths(model)
    reference = PinLedger()
    ref_model = CountedModel(model, reference)
    make_cache = lambda: make_prompt_cache(model)  # noqa: E731
    run_units(_ladder_whole(ref_model, make_cache, draws, K, (Level.WIDE, Level.NARROW)))
    kernels.apply_widths(model, verdict.widths)
    run_units(
        pin_cost_steps(ref_model, make_cache, draws[0].prompt, [Level.NARROW, Level.PER_QUERY, Level.PER_QUERY_1], 8)
    )
    run_units(warm_steps(ref_model, make_cache, Level.NARROW, [2, 3, 4], draws[0].prompt))

    def counts(lg: PinLedger) -> dict[str, list[tuple[str, str, int, int]]]:
        snap = lg.snapshot()
        return {
            t: [(r["level"], r["purpose"], r["forwards"], r["rows"]) for r in snap[t]]
            for t in ("pinned", "unrequested")
        }

    assert counts(ledger) == counts(reference)


# --------------------------------------------------------------------------- serving between units


def test_what_serves_between_units_runs_at_the_serving_level(model_path: Path) -> None:
    """A probe pinned to padded (its chain, blocks, pin cost and warm-up all pinned) driven a unit at a
    time with nothing around it: between any two units the level in force is the process's (wide,
    unasked) and a serving forward is counted as serving at wide, never at the probe's pin or purpose."""
    model = load_measured(model_path)
    ledger = PinLedger()
    counted = CountedModel(model, ledger)
    draws = make_draws(K, VOCAB, 4096, None)[:2]
    policy = ProbePolicy(pinned_level=Level.PADDED)
    steps = probe_steps(
        counted, lambda: make_prompt_cache(model), {"t": "serve"}, draws, K, policy=policy, warm=[2, 3, 4], max_batch=1
    )
    serving, served = make_prompt_cache(model), PinLedger()
    server = CountedModel(model, served)
    seen: list[tuple[Level, bool]] = []

    def serve() -> None:
        seen.append((current_level(), in_scoped_pin()))
        mx.eval(server(mx.array([[7]]), cache=serving))

    labels, verdict = run_units(steps, serve)
    assert verdict.level == "padded", verdict.reason
    assert len(seen) == len(labels) > 20
    assert set(seen) == {(Level.WIDE, False)}
    snap = served.snapshot()
    assert snap["pinned"] == []
    assert [(r["level"], r["purpose"], r["forwards"]) for r in snap["unrequested"]] == [
        ("wide", "serving", len(labels))
    ]
    pinned = {(r["level"], r["purpose"]) for r in ledger.snapshot()["pinned"]}
    assert {("padded", "serving"), ("padded", "warm")} <= pinned  # the probe's own forwards were pinned


def test_the_plain_calls_still_run_a_draw_whole(model_path: Path) -> None:
    """``run_chain`` and ``run_block`` (the synchronous entry points' pieces) give the units' bytes."""
    model = load_measured(model_path)
    make_cache = layout_stable(lambda: make_prompt_cache(model))
    draw = make_draws(K, VOCAB, 4096, None)[0]
    chain, fed = draws_mod.run_chain(model, make_cache, draw, K + 1)
    whole, whole_fed = _chain_whole(model, make_cache, draw, K + 1, Level.WIDE)
    assert fed == whole_fed and compare(chain, whole)[1] == 0
    block = draws_mod.run_block(model, make_cache, draw, fed, Level.NARROW)
    assert compare(block, _block_whole(model, make_cache, draw, fed, Level.NARROW))[1] == 0
