"""The ladder: each rung tried on every draw until one is exact, a forward per step.

For each rung, cheapest first (``levels.ladder()``), every draw's chain (classic decode, run twice
to see it reproduce) is compared with its block at that rung; the first divergence ends the rung.
At a calibrated rung each block is run with its projections' widths verified on its own rows
(``draws.run_calibrated_block``); a draw that narrows a width after earlier draws passed
starts the rung over, so the widths a verdict carries held on every draw. The verdict is the first
exact rung, or declined (fail closed) unless the operator's policy says otherwise.

Each draw is many steps of one forward (``draws.chain_steps``, ``draws.block_steps``), so an engine
serving between them keeps a request waiting for one forward, not a draw.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import mlx.core as mx

from workers.api import Level, ProbePolicy
from workers.exact.draws import (
    WITHIN,
    Draw,
    MakeCache,
    block_steps,
    calibrated_block_steps,
    chain_level,
    chain_steps,
    compare,
    layout_stable,
    timed,
)
from workers.exact.localize import localize
from workers.exact.results import DrawResult, LevelResult
from workers.kernels import every_width_one, install, ladder, reset_widths

#: Exact or declined, nothing pinned.
_DEFAULT_POLICY = ProbePolicy()

LadderOutcome = tuple[Level | None, bool, str, list[LevelResult]]


def ladder_steps(
    model: Any,
    make_cache: MakeCache,
    draws: list[Draw],
    k: int,
    policy: ProbePolicy = _DEFAULT_POLICY,
    levels: tuple[Level, ...] | None = None,
) -> Generator[str, None, LadderOutcome]:
    """The ladder, one forward per step: yields the draw's label (``level: draw``) before each draw,
    then ``level: draw / ...`` after each of its forwards, and returns (level or None, exact, reason,
    per-level results). The engine drives it a step at a time between batched steps; ``drive`` runs
    it to the end. Widths start from the load-time measurement and are calibrated at each calibrated
    rung (they stay narrowed for later rungs). A draw's ``seconds`` are its own steps' time."""
    install()
    make_cache = layout_stable(make_cache)
    reset_widths(model)
    paths = {id(m): path for path, m in model.named_modules()}
    width = k + 1
    #: Classic decode per (draw, the level it runs at): run twice, the second only to see it reproduce.
    baselines: dict[tuple[str, Level], tuple[mx.array, list[int], int]] = {}
    if policy.pinned_level is not None:
        levels = (policy.pinned_level,)
    elif levels is None:
        levels = ladder()
    results: list[LevelResult] = []
    for i, level in enumerate(levels):
        lr = LevelResult(level.value, exact=True)
        if level is Level.PER_QUERY and Level.PER_QUERY_1 in levels[i + 1 :] and every_width_one(model):
            lr.exact, lr.skipped = False, "calibration left every projection at one row: this is per-query-1"
            results.append(lr)
            continue
        tic_level = time.perf_counter()
        queue, ran = list(draws), set[str]()
        while queue:
            draw = queue.pop(0)
            head = f"{level.value}: {draw.name}" + (" (again, with narrowed widths)" if draw.name in ran else "")
            yield head
            ran.add(draw.name)
            busy = [0.0]
            dr, narrowed = yield from timed(
                _draw_steps(model, make_cache, draw, width, level, policy, baselines, head), busy
            )
            dr.seconds = busy[0]
            for mid, (before, after) in narrowed.items():
                path = paths.get(mid, str(mid))
                lr.narrowed[path] = [lr.narrowed.get(path, [before])[0], after]
            if narrowed and lr.draws and (dr.exact or dr.accepted_as_classic_variation):
                # The rung's earlier draws passed with wider widths: the widths a verdict carries
                # must hold on every draw, so the rung starts over with these.
                lr.draws, queue = [], list(draws)
                continue
            lr.draws.append(dr)
            if not (dr.exact or dr.accepted_as_classic_variation):
                lr.exact = False
                break  # stop at the first divergence
        lr.seconds = time.perf_counter() - tic_level
        results.append(lr)
        if lr.exact:
            if any(d.nondeterministic for d in lr.draws):
                # Accepted by policy, but nothing is byte-identical to guarantee: not exact.
                return (
                    level,
                    False,
                    "no worse than classic decode's own run-to-run variation (operator policy)",
                    results,
                )
            return level, True, "exact at every draw" + _calibration_note(results), results
    last = next(lr for lr in reversed(results) if lr.draws).draws[-1]
    failed = next(lr for lr in reversed(results) if lr.draws).level
    why = (
        f"classic decode is not reproducible at draw {last.draw} ({last.chain_vs_chain_bytes} bytes differ chain vs chain)"
        if last.nondeterministic
        else f"no level is exact: at {failed}, draw {last.draw} position {last.first_position} "
        f"differs in {last.differing_bytes} of {last.total_bytes} logit bytes"
    )
    if policy.pinned_level is not None:
        return (
            policy.pinned_level,
            False,
            f"operator pinned {policy.pinned_level.value}, which is inexact: {why}",
            results,
        )
    if policy.allow_inexact:
        return Level.WIDE, False, f"allow_inexact: bursts run at wide, marked inexact ({why})", results
    return None, False, f"declined: {why}", results


def _draw_steps(
    model: Any,
    make_cache: MakeCache,
    draw: Draw,
    width: int,
    level: Level,
    policy: ProbePolicy,
    baselines: dict[tuple[str, Level], tuple[mx.array, list[int], int]],
    head: str,
) -> Generator[str, None, tuple[DrawResult, dict[int, tuple[int, int]]]]:
    """One draw at ``level``, a forward per unit (labels ``head / ...``): classic decode's chain (twice,
    unless ``baselines`` holds it), the block, and their comparison; returns the draw's result (its
    seconds left to the caller) and the widths its calibration narrowed."""
    base = (draw.name, chain_level(level))
    if base not in baselines:
        chain1, fed = yield from chain_steps(model, make_cache, draw, width, base[1], f"{head}{WITHIN}chain")
        chain2, _ = yield from chain_steps(model, make_cache, draw, width, base[1], f"{head}{WITHIN}chain again")
        baselines[base] = (chain1, fed, compare(chain1, chain2)[1])
    chain, fed, classic_var = baselines[base]
    narrowed: dict[int, tuple[int, int]] = {}
    if level.calibrated:
        block, narrowed = yield from calibrated_block_steps(model, make_cache, draw, fed, level, f"{head}{WITHIN}block")
    else:
        block = yield from block_steps(model, make_cache, draw, fed, level, what=f"{head}{WITHIN}block")
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
    if classic_var:
        dr.nondeterministic = True
        dr.accepted_as_classic_variation = policy.accept_classic_variation and diff <= classic_var
        dr.exact = False
    if not dr.exact and first is not None and policy.localize:
        # A diagnosis the operator asked for: one unit, its captures installed and removed within it.
        dr.first_divergence = localize(model, make_cache, draw, fed, level, first)
    return dr, narrowed


def _calibration_note(results: list[LevelResult]) -> str:
    narrowed = {path for lr in results for path in lr.narrowed}
    if not narrowed:
        return ""
    return f"; {len(narrowed)} projection widths narrowed by calibration on the probe's activations"
