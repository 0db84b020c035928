"""Timing the ways to run a projection on a row count, and checking the choice on whole forwards.

MLX CUDA records a step's kernels as a CUDA graph whose edges are the data they share, so kernels that
do not depend on each other may run at the same time. Calls timed side by side (eight calls on one
input in one evaluation) measured how many calls the device completes together, not how long a
forward waits for one: such timings chose plans that made small batches' decode forwards slower
than mlx-lm's own calls. So here each timed call takes the previous call's output as part of its input (one
chain: the next call waits for this one), and then, for each row count, the plans are checked on
the model's own decode steps against running every projection one way (as called, flattened,
padded, through the project's kernel): decode steps chained as the engine runs them are what a
step pays for (``forward_ms``).

Calibrating a model out of these (all at once, or in units between a daemon's steps) is
``plan_units``.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Generator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from workers.kernels import dense_shadow, dequant_matmul, fastpath, qmv_rows, w4a16, w4a16_source

log = logging.getLogger("mlx_batchd")

#: A way to run one projection: ``(rows, d_in)`` -> ``(rows, d_out)``.
Way = Callable[[mx.array], mx.array]
Plans = dict[str, dict[int, int]]

#: Chained calls per timed evaluation: one call alone times the launch and the host's wait.
CALLS_PER_EVAL = 8
#: Timed rounds per candidate, interleaved with the other candidates; the median is kept.
ROUNDS = 5
#: A candidate must beat the default (flattened-unpadded for one projection, the per-shape plans for
#: a forward) by this fraction to replace it: near-ties are noise, not a plan.
MARGIN = 0.03
#: Tokens of context before the timed decode steps, steps per timed chain, chains per candidate.
FORWARD_CONTEXT = 32
FORWARD_STEPS = 6
FORWARD_ROUNDS = 3


def _chain(call: Way, x: mx.array, n: int) -> mx.array:
    """``n`` calls, each on ``x`` plus nothing of the previous call's output (so it waits for it)."""
    for _ in range(n):
        y = call(x)
        x = x + (y[:, :1] * 0).astype(x.dtype)
    return x


def _ms(calls: list[Way], x: mx.array) -> list[float]:
    """Each way's milliseconds per call on ``x``: ``CALLS_PER_EVAL`` chained calls in one evaluation,
    the ways interleaved round by round (a slow moment of the device lands on all of them), the
    median of ``ROUNDS`` rounds."""
    for f in calls:
        mx.eval(_chain(f, x, CALLS_PER_EVAL))
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(ROUNDS):
        for i, f in enumerate(calls):
            mx.synchronize()
            tic = time.perf_counter()
            mx.eval(_chain(f, x, CALLS_PER_EVAL))
            mx.synchronize()
            samples[i].append(1e3 * (time.perf_counter() - tic) / CALLS_PER_EVAL)
    return [sorted(s)[len(s) // 2] for s in samples]


def _way(f: Callable[..., mx.array], m: nn.Module, to: int) -> Way:
    """``m`` called as ``project`` calls it on ``to`` rows: 0 or 1 as mlx-lm calls it (``(rows, 1, D)``),
    the rows themselves flattened, or a larger pad size (padding and slice included: they cost a step
    as much as a small projection does; the padding shared with a sibling's call is not counted)."""

    def call(x: mx.array) -> mx.array:
        rows = x.shape[0]
        if to in (0, 1):
            return f(m, x.reshape(rows, 1, x.shape[-1])).reshape(rows, -1)
        if to == rows:
            return f(m, x)
        return f(m, fastpath._pad(x, to))[:rows]

    return call


def _kernel_way(kernel: fastpath.RowKernel) -> Way:
    def call(x: mx.array) -> mx.array:
        out = kernel(x)
        assert out is not None  # checked to take the module before it is timed
        return out

    return call


def _tile_way(kernel: fastpath.TileKernel, tile: int) -> Way:
    return _kernel_way(lambda x: kernel(x, tile))


def row_kernel(m: nn.Module) -> fastpath.RowKernel | None:
    """The project's multi-row kernel on ``m`` where it takes it here (an affine-quantized layer on
    MLX CUDA, compiled and byte-equal to MLX's one-row call on this shape), else ``None``."""
    original = getattr(type(m).__call__, "__wrapped__", type(m).__call__)

    def kernel(x: mx.array) -> mx.array | None:
        return qmv_rows.project(m, original, x)

    d_in = m.weight.shape[-1] * 32 // m.bits if isinstance(m, nn.QuantizedLinear) else 0
    if not d_in:
        return None
    return kernel if kernel(mx.zeros((1, d_in), dtype=m.scales.dtype)) is not None else None


def mma_kernel(m: nn.Module) -> fastpath.TileKernel | None:
    """The w4a16 tensor-core kernel on ``m`` (rows, tile) where it takes it here (``w4a16.takes``), else ``None``."""
    return (lambda x, tile: w4a16.project(m, x, tile)) if w4a16.takes(m) else None


def dense_kernel(m: nn.Module) -> fastpath.RowKernel | None:
    """``m`` through its dequantized shadow (``dense_shadow``) where it has one, else ``None``."""
    return (lambda x: dense_shadow.project(m, x)) if dense_shadow.has(m) else None


def dequant_kernel(m: nn.Module) -> fastpath.RowKernel | None:
    """``m`` through a transient dequantized weight (``dequant_matmul``) where it takes it here, else ``None``."""
    return (lambda x: dequant_matmul.project(m, x)) if dequant_matmul.takes(m) else None


def mma_ways(rows: int) -> list[int]:
    """The plan values timed for the w4a16 kernel on ``rows`` rows: ``fastpath.MMA``, and from
    ``w4a16_source.TILE_ROWS`` rows one more for each other tile of ``w4a16_source.TILES``."""
    tiles = len(w4a16_source.TILES) if rows >= w4a16_source.TILE_ROWS else 1
    return [fastpath.MMA - t for t in range(tiles)]


def time_plan(m: nn.Module, n: int) -> dict[int, int]:
    """``time_plan_steps`` run to its end."""
    plan: dict[int, int] = drive(time_plan_steps(m, n))
    return plan


def time_plan_steps(m: nn.Module, n: int, large: tuple[int, ...] | None = None) -> Generator[str, None, dict[int, int]]:
    """Row count -> the cheapest way to call ``m`` on it: 0 (as mlx-lm calls it, ``(rows, 1, D)``),
    flattened to ``(rows, D)``, flattened and padded to a size in ``fastpath.PADS``,
    ``fastpath.KERNEL`` (up to its rows, where it takes ``m``) or the w4a16 kernel's tiles (``mma_ways``,
    where it takes ``m``; then ``large`` (default ``fastpath.LARGE_ROWS``) are timed too, flattened
    against it), and from
    ``dense_shadow.MIN_ROWS`` rows ``fastpath.DENSE`` where ``m`` has a shadow (the large rows too), from
    ``dequant_matmul.MIN_ROWS`` rows ``fastpath.DEQUANT`` where that takes ``m`` (likewise).
    Flattened-unpadded is kept unless another way is cheaper by ``MARGIN``. One row (classic decode)
    is timed as mlx-lm calls it against the row kernel only, where that takes ``m``.

    As units: each way's first call on a row count (where a kernel compiles: a unit holds at most one
    compile, so a request waits for no more), then that row count's timing."""
    original = getattr(type(m).__call__, "__wrapped__", type(m).__call__)
    bits = getattr(m, "bits", None)
    d_in = m.weight.shape[-1] * (32 // bits if bits else 1)
    dtype = m.scales.dtype if bits else m.weight.dtype
    kernel = row_kernel(m)
    mma = mma_kernel(m)
    dense = dense_kernel(m)
    dequant = dequant_kernel(m)
    plan: dict[int, int] = {}
    timed_large = mma is not None or dense is not None or dequant is not None
    large = (fastpath.LARGE_ROWS if large is None else large) if timed_large else ()
    for rows in [*range(1 if kernel else 2, n + 1), *(r for r in large if r > n)]:
        if rows > n:
            ways = [rows]
        else:
            ways = [0, rows, *(p for p in fastpath.PADS if p > rows)] if rows > 1 else [1]
        if kernel is not None and rows <= qmv_rows.MAX_ROWS:
            ways.append(fastpath.KERNEL)
        if mma is not None and rows > 1:
            ways += mma_ways(rows)
        if dense is not None and rows >= dense_shadow.MIN_ROWS:
            ways.append(fastpath.DENSE)
        if dequant is not None and rows >= dequant_matmul.MIN_ROWS:
            ways.append(fastpath.DEQUANT)
        calls = [
            _kernel_way(kernel)
            if to == fastpath.KERNEL and kernel is not None
            else _kernel_way(dense)
            if to == fastpath.DENSE and dense is not None
            else _kernel_way(dequant)
            if to == fastpath.DEQUANT and dequant is not None
            else _tile_way(mma, tile)
            if (tile := fastpath.tile(to)) is not None and mma is not None
            else _way(original, m, to)
            for to in ways
        ]
        x = mx.zeros((rows, d_in), dtype=dtype)
        for to, call in zip(ways, calls, strict=True):
            mx.eval(call(x))
            yield f"{rows} rows: way {to} ready"
        costs = dict(zip(ways, _ms(calls, x), strict=True))
        best = min(costs, key=lambda k: costs[k])
        plan[rows] = best if costs[best] < (1 - MARGIN) * costs[rows] else rows
        yield f"{rows} rows timed"
    return plan


# --------------------------------------------------------------------------- whole forwards


def decodes(model: nn.Module) -> bool:
    """Whether ``model`` runs a decode forward (takes a KV cache): the forward check needs one."""
    try:
        return "cache" in inspect.signature(model.__call__).parameters
    except (TypeError, ValueError):
        return False


def greedy(logits: mx.array) -> mx.array:
    """The last position's greedy token of each row, ``(rows, 1)`` int32: what a chained step feeds on."""
    return mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)


def chained_ms(step: Callable[[mx.array], mx.array], first: mx.array, steps: int) -> float:
    """Milliseconds per call of ``steps`` calls of ``step``, each on the previous call's output (from
    ``first``), stepped as a decode loop steps: the next call built and queued (``async_eval``) before
    the host reads the last one's output, so graph building overlaps the device's work."""
    mx.synchronize()
    tic = time.perf_counter()
    token, last = first, None
    for _ in range(steps):
        token = step(token)
        mx.async_eval(token)
        if last is not None:
            last.tolist()
        last = token
    if last is not None:
        last.tolist()
    return 1e3 * (time.perf_counter() - tic) / max(steps, 1)


def forward_ms(model: nn.Module, rows: int, installs: list[Callable[[], None]]) -> list[float]:
    """Milliseconds per decode step on ``rows`` sequences of ``FORWARD_CONTEXT`` tokens after each
    ``installs[i]()``, stepped as the engine steps: ``FORWARD_STEPS`` forwards, each fed the previous
    one's greedy token, the next built and queued (``async_eval``) before the host reads the last one's
    tokens. The candidates interleaved round by round, one untimed step each first, the median of
    ``FORWARD_ROUNDS``. The cache is cut back after each chain, so every chain reads the same context.

    Why chained and not one synchronous forward: a synchronous forward costs graph building plus
    device time, while a decode loop builds the next step while the device runs this one and pays
    about the larger of the two. A synchronous check favoured the way whose graph is heavier to build
    (the project's kernel), and the engine's steps were then slower than with the other plans."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((rows, FORWARD_CONTEXT), dtype=mx.int32), cache=cache))
    first = mx.zeros((rows, 1), dtype=mx.int32)
    trim = can_trim_prompt_cache(cache)

    def chain(steps: int = FORWARD_STEPS) -> float:
        ms = chained_ms(lambda token: greedy(model(token, cache=cache)), first, steps)
        if trim:
            trim_prompt_cache(cache, steps)
        return ms

    for install in installs:
        install()
        chain(1)
    samples: list[list[float]] = [[] for _ in installs]
    for _ in range(FORWARD_ROUNDS):
        for i, install in enumerate(installs):
            install()
            samples[i].append(chain())
    return [sorted(s)[len(s) // 2] for s in samples]


def candidates(
    plans: Plans,
    kernel_shapes: set[str],
    rows: int,
    mma_shapes: set[str] | None = None,
    n: int = 0,
    dense_shapes: set[str] | None = None,
    dequant_shapes: set[str] | None = None,
) -> list[tuple[str, dict[str, int]]]:
    """Ways to run every projection on ``rows`` rows, by name: the per-shape plans first, then each
    uniform way (a kernel where it takes the shape, the plan elsewhere); duplicates dropped. One row
    concerns only the shapes the row kernel takes (elsewhere it is always as mlx-lm calls it); rows
    above ``n`` (``fastpath.LARGE_ROWS``) are flattened or through the w4a16 kernel (``mma_shapes``) or
    the dequantized shadow (``dense_shapes``, from ``dense_shadow.MIN_ROWS`` rows) or a transient
    dequantized weight (``dequant_shapes``, from ``dequant_matmul.MIN_ROWS`` rows)."""
    mma_shapes = mma_shapes or set()
    shapes = sorted(kernel_shapes) if rows == 1 else sorted(plans)
    planned = {shape: plans[shape].get(rows, rows) for shape in shapes}
    out = [("plans", planned)]
    if rows == 1:
        out.append(("as called", dict.fromkeys(shapes, 1)))
    elif n and rows > n:
        out.append(("flattened", dict.fromkeys(shapes, rows)))
    else:
        out += [("as called", dict.fromkeys(shapes, 0)), ("flattened", dict.fromkeys(shapes, rows))]
        out += [(f"padded to {p}", dict.fromkeys(shapes, p)) for p in fastpath.PADS if p > rows]
    if mma_shapes and rows > 1:
        out.append(("w4a16", {s: fastpath.MMA if s in mma_shapes else v for s, v in planned.items()}))
    if dense_shapes and rows >= dense_shadow.MIN_ROWS:
        out.append(("dense", {s: fastpath.DENSE if s in dense_shapes else v for s, v in planned.items()}))
    if dequant_shapes and rows >= dequant_matmul.MIN_ROWS:
        out.append(("dequant", {s: fastpath.DEQUANT if s in dequant_shapes else v for s, v in planned.items()}))
    if kernel_shapes and rows <= qmv_rows.MAX_ROWS:
        out.append(("kernel", {s: fastpath.KERNEL if s in kernel_shapes else v for s, v in planned.items()}))
    unique: list[tuple[str, dict[str, int]]] = []
    for name, option in out:
        if all(option != o for _, o in unique):
            unique.append((name, option))
    return unique


def forward_checked(
    model: nn.Module,
    plans: Plans,
    kernel_shapes: set[str],
    n: int,
    report: dict[int, dict[str, Any]] | None = None,
    mma_shapes: set[str] | None = None,
    dense_shapes: set[str] | None = None,
    dequant_shapes: set[str] | None = None,
) -> Plans:
    """``plans`` with each row count's ways replaced by the uniform way whose decode forward is
    cheaper by ``MARGIN`` (``forward_check_steps`` run to its end)."""
    result: Plans = drive(
        forward_check_steps(model, plans, kernel_shapes, n, report, mma_shapes, dense_shapes, dequant_shapes)
    )
    return result


def forward_check_steps(
    model: nn.Module,
    plans: Plans,
    kernel_shapes: set[str],
    n: int,
    report: dict[int, dict[str, Any]] | None = None,
    mma_shapes: set[str] | None = None,
    dense_shapes: set[str] | None = None,
    dequant_shapes: set[str] | None = None,
) -> Generator[str, None, Plans]:
    """The forward check as units, one row count each (yielding what it checked), ending in ``plans``
    with each row count's ways replaced by the uniform way whose decode forward is cheaper by
    ``MARGIN`` (``candidates``; the plans are installed on ``model`` meanwhile), for 2..``n`` rows
    (one too where the row kernel takes a shape) and, where the w4a16 kernel takes one
    (``mma_shapes``), a shape has a shadow (``dense_shapes``) or a transient dequantized weight
    (``dequant_shapes``), the large row counts ``plans`` hold
    (``time_plan_steps``' ``large``). ``report`` (when given) gets each row count's forward
    milliseconds by candidate and the one kept. A unit leaves its row count's kept way installed;
    the next unit installs what it times itself, so the caller may install other plans in between."""
    timed_large = mma_shapes or dense_shapes or dequant_shapes
    large = sorted({r for plan in plans.values() for r in plan if r > n}) if timed_large else []
    for rows in [*range(1 if kernel_shapes else 2, n + 1), *large]:
        options = candidates(plans, kernel_shapes, rows, mma_shapes, n, dense_shapes, dequant_shapes)
        if len(options) < 2:
            continue

        def install(option: dict[str, int], rows: int = rows) -> Callable[[], None]:
            def apply() -> None:
                for shape, to in option.items():
                    plans[shape][rows] = to
                fastpath.install(model, plans)

            return apply

        costs = forward_ms(model, rows, [install(o) for _, o in options])
        best = min(range(len(options)), key=lambda i: costs[i])
        kept = best if costs[best] < (1 - MARGIN) * costs[0] else 0
        install(options[kept][1])()
        timings = ", ".join(f"{name} {ms:.3f}" for (name, _), ms in zip(options, costs, strict=True))
        log.info("kernel plans, %d rows: decode forward ms %s; kept %s", rows, timings, options[kept][0])
        if report is not None:
            report[rows] = {
                "ms": dict(zip((name for name, _ in options), costs, strict=True)),
                "kept": options[kept][0],
            }
        yield f"forward check, {rows} rows"
    return plans


def drive(steps: Generator[str, None, Any], progress: Callable[[str], None] | None = None) -> Any:
    """Run a step generator (the calibration's, the probe's, a check's) to its end and return its
    value; ``progress`` gets each step's label."""
    while True:
        try:
            label = next(steps)
        except StopIteration as done:
            return done.value
        if progress is not None:
            progress(label)
