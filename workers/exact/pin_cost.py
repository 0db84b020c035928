"""What a process-wide pin would cost batched decode, measured once by the probe and kept with its verdict.

A scoped pin runs only verify forwards at the verdict's level; a process-wide pin (the seed's way,
kept only as a bench arm) would run every batched decode step at it too. After the ladder the probe
times one batched decode step at each pinning rung against ``wide``, at each of ``BATCH_BUCKETS``
sequences, on scratch caches (serving state is untouched), one forward per probe step. The
rows are stored with the verdict, so a pairing is measured once; serving never stops to measure.
``summary`` turns them and the engine's decode seconds per bucket into the stats' ``pin_tax``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx

from workers.api import Level
from workers.exact.draws import WITHIN, MakeCache, layout_stable, prefill_chunk
from workers.kernels import mlxlm, scoped

log = logging.getLogger("mlx_batchd.probe")

#: Decode batch sizes the cost is measured at; a step of B sequences counts at the bucket nearest B.
BATCH_BUCKETS = (1, 8, 32, 128)
#: Tokens already in each scratch sequence's cache before the timed steps.
CONTEXT = 32
#: Timed steps per arm after one untimed (the median is kept).
REPS = 3


@dataclass
class PinCost:
    """One batched decode step at ``batch`` sequences: wide, and pinned at ``level``."""

    level: str
    batch: int
    wide_step_s: float
    pinned_step_s: float
    #: ``pinned_step_s / wide_step_s``.
    ratio: float


def bucket(batch: int) -> int:
    """The bucket a decode step of ``batch`` sequences counts at: the nearest one (the smaller on a tie)."""
    return min(BATCH_BUCKETS, key=lambda b: (abs(b - batch), b))


def pinning_rungs(rungs: Iterable[str], skipped: Iterable[str]) -> list[Level]:
    """The rungs a process-wide pin could be at: the ladder's (``rungs``), less ``wide`` and those
    the ladder skipped as the same as another."""
    gone = set(skipped)
    return [Level(r) for r in rungs if r != Level.WIDE.value and r not in gone]


def pin_cost_steps(
    model: Any, make_cache: MakeCache, prompt: list[int], levels: list[Level], max_batch: int | None = None
) -> Generator[str, None, list[PinCost]]:
    """Time a batched decode step at each of ``levels`` against wide, for every bucket up to
    ``max_batch`` (a serving engine never decodes more together; ``None``: every bucket), a forward
    per step (``head / ...`` labels), each pair's last step labelled ``pin cost at LEVEL, batch B``. A
    pair that fails is left out (logged): the verdict stands without it."""
    rows: list[PinCost] = []
    if not levels:
        return rows
    make_cache = layout_stable(make_cache)  # as every cache the probe builds (merged, it is sized to its tokens)
    context = (prompt * (CONTEXT // max(1, len(prompt)) + 1))[:CONTEXT]
    for batch in (b for b in BATCH_BUCKETS if max_batch is None or b == 1 or b <= max_batch):
        for level in levels:
            head = f"pin cost at {level.value}, batch {batch}"
            try:
                rows.append((yield from _measure_steps(model, make_cache, context, batch, level, head)))
            except Exception as exc:  # a rung that cannot run batched costs its row only
                log.warning("pin cost at %s, batch %d not measured: %r", level.value, batch, exc)
            yield head
    return rows


def _measure_steps(
    model: Any, make_cache: MakeCache, context: list[int], batch: int, level: Level, head: str
) -> Generator[str, None, PinCost]:
    """One (level, batch) pair a forward per unit: the scratch prefill's chunks, then each timed step
    (wide and pinned in turn), the level entered and left within its step's unit. No yield after the
    last step: the caller's ``head`` ends that unit."""
    single = make_cache()
    chunk = prefill_chunk()
    count = -(-len(context) // chunk)
    for n, i in enumerate(range(0, len(context), chunk), 1):
        with scoped(Level.WIDE):
            model(mx.array([context[i : i + chunk]]), cache=single)
            mx.eval([c.state for c in single])
        yield f"{head} / prefill {n}/{count}"
    merged = mlxlm.merge_caches([single] * batch)  # the batch cache batched decode steps on
    mx.eval([c.state for c in merged])
    step = mx.array([[context[-1]]] * batch)
    times: dict[Level, list[float]] = {Level.WIDE: [], level: []}
    for rep in range(REPS + 1):
        for lv in (Level.WIDE, level):
            tic = time.perf_counter()
            with scoped(lv):
                mx.eval(model(step, cache=merged))
            times[lv].append(time.perf_counter() - tic)
            if not (rep == REPS and lv is level):
                yield f"{head}{WITHIN}{lv.value} step {rep + 1}/{REPS + 1}"
    wide, pinned = (sorted(times[lv][1:])[REPS // 2] for lv in (Level.WIDE, level))
    return PinCost(level.value, batch, wide, pinned, pinned / wide)


def summary(
    rows: list[PinCost], verdict_level: str | None, decode_seconds: dict[int, float], process_wide: bool
) -> dict[str, Any]:
    """The stats' ``pin_tax``: every measured row, the level a process-wide pin would run at (the
    verdict's where it pins, else the first rung measured), and the batched decode seconds scoping
    saved: each bucket's seconds would have cost its ratio at that level (the nearest bucket measured;
    a ratio under 1 is noise and saves nothing; 0 under a process-wide pin). Empty without rows."""
    if not rows:
        return {}
    pinning = verdict_level not in (None, Level.WIDE.value) and any(r.level == verdict_level for r in rows)
    level = verdict_level if pinning else rows[0].level
    ratio = {r.batch: r.ratio for r in rows if r.level == level}
    saved = 0.0
    if not process_wide:
        for b, seconds in decode_seconds.items():
            nearest = min(ratio, key=lambda m: (abs(m - b), m))
            saved += max(0.0, ratio[nearest] - 1.0) * seconds
    return {
        "level": level,
        "rows": [asdict(r) for r in rows],
        "estimated_seconds_saved_by_scoping": saved,
    }
