"""The batched kernel path: how the engine's forwards reach MLX's fast batched kernels.

mlx-lm calls every projection on ``(B, T, D)`` activations. On MLX CUDA a ``(B, 1, D)`` quantized
projection runs as B matrix-vector products, while the same rows as one ``(B, D)`` matrix reach the
batched kernel (several times faster at B = 32 on an 8B 4-bit model). The same
backend's fused attention is run-to-run reproducible for a single sequence only on contiguous K/V
(over the cache's strided views it is not), which exactness needs. Small row counts are planned per
projection shape by timing (``plan_timing.calibrate``, once per machine: ``plan_store``): as mlx-lm calls them,
flattened, or padded.

On the same backend a decode step's layers also run as compiled halves around attention
(``compiled_layers``; the policy's ``compiled_layers``): at B <= 8 graph building sets the step.

This is the ``wide`` level as the project drives MLX: batched decode and prefill always use it, and
it makes no byte-identity promise beyond what the backend gives (MLX's CPU backend stays row-exact,
so CPU results are unchanged). The exact levels (``narrow``, ``per-query``) chunk rows themselves and
are untouched by it, except for contiguous K/V, which every attention call gets on backends that need
it (classic decode must be reproducible for exactness to mean anything).

One switch per backend, chosen at first use; ``MLX_BATCHD_FASTPATH=off`` turns it off (the stock
mlx-lm behaviour, for comparison), ``=cuda`` forces the CUDA policy anywhere (tests, benchmarks).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn

from workers import envs

log = logging.getLogger("mlx_batchd")


@dataclass(frozen=True)
class FastPath:
    name: str
    #: Call projections on ``(rows, D)`` instead of ``(B, T, D)``.
    flatten: bool = False
    #: Time each projection shape at load for 2..N rows and keep the cheapest way to run each row
    #: count: as mlx-lm calls it, flattened, or flattened and padded to 8 or 16 rows (0 = off).
    calibrate_rows: int = 0
    #: Copy a single sequence's K/V to contiguous arrays before the fused attention. On MLX CUDA the
    #: fused kernel over the cache's strided views is not run-to-run reproducible inside a model
    #: forward (343 of 600 classic decode positions differed between two identical runs; 0 with the
    #: copy, at no measurable cost). Batched forwards skip it: there the copy costs up to 2.7x the
    #: attention itself at long contexts and buys nothing (no byte-identity promise).
    contiguous_kv: bool = False
    #: Whether the probe tries the ``padded`` rung (``kernels.Level.PADDED``) right after ``wide``,
    #: before the chunking rungs. On MLX CUDA it is the cheap exact rung: a 5-row verify chunked to
    #: one row per call costs 4.4 classic steps, while the batched kernel at 16 rows costs about one
    #: matrix-vector product. Elsewhere it comes after them (unmeasured there; chunks of a measured
    #: width cost the chain nothing).
    padded_first: bool = False
    #: Run decode steps' decoder layers as compiled halves around attention (``compiled_layers``): at
    #: B <= 8 the host's graph building sets the step.
    compiled_layers: bool = False
    #: With ``compiled_layers``, classic B = 1 decode too (the chain bursts reproduce: the probe
    #: measures its verdicts on the compiled chain, which is shorter a step than the plain one).
    compiled_lone: bool = True


OFF = FastPath("off")
#: MLX's CPU and Metal backends: flattening costs nothing and lets every batch take one matmul.
GENERIC = FastPath("generic", flatten=True)
#: MLX CUDA. Below 8 rows its batched quantized kernel costs about M matrix-vector products, and which
#: row count is cheapest depends on the projection's shape, so the plan per row count is calibrated on
#: the machine (``benchmarks/fastpath_probe.py`` measures the costs).
CUDA = FastPath(
    "cuda",
    flatten=True,
    calibrate_rows=16,
    contiguous_kv=True,
    padded_first=True,
    compiled_layers=True,
)

_POLICIES = {p.name: p for p in (OFF, GENERIC, CUDA)}
_active: FastPath | None = None


def detect() -> FastPath:
    """The policy for this process: ``MLX_BATCHD_FASTPATH`` if set, else by the default device;
    ``MLX_BATCHD_COMPILED_LAYERS=0|1`` overrides its ``compiled_layers`` (``workers.envs``)."""
    forced = envs.read(envs.FASTPATH)
    if forced:
        policy = _POLICIES[forced]
    else:
        policy = CUDA if mx.default_device() == mx.gpu and mx.cuda.is_available() else GENERIC
    compiled = envs.switch(envs.COMPILED_LAYERS)
    return policy if compiled is None else replace(policy, compiled_layers=compiled)


def active() -> FastPath:
    global _active
    if _active is None:
        _active = detect()
    return _active


def set_active(policy: FastPath | None) -> None:
    """Pick a policy (``None``: detect again at next use). For tests and benchmarks."""
    global _active
    _active = policy


#: Per projection module (by id): row count -> rows of the kernel call (0: leave the call as mlx-lm
#: makes it; ``KERNEL``: the project's multi-row kernel). Filled by ``calibrate``; row counts not in
#: a plan are flattened, unpadded (one row: as mlx-lm calls it).
_plans: dict[int, dict[int, int]] = {}
#: A plan's value for "through ``qmv_rows``": one pass over the weights for up to ``qmv_rows.MAX_ROWS``
#: rows, each row computed with MLX's own one-row arithmetic (checked byte for byte against MLX's call
#: per layer shape at first use, or not used). On MLX CUDA, below 8 rows MLX's batched kernel costs
#: about one matrix-vector product per row.
KERNEL = -1
#: A plan's value for "through the w4a16 tensor-core kernel" (``w4a16``): decode steps only (one
#: token a sequence), 4-bit projections on MLX CUDA, where MLX's quantized matmul at 16-256 rows
#: fills few SMs.
MMA = -2
#: A plan's value for "through the dequantized shadow" (``dense_shadow``, ``serve --dense-shadow``):
#: ``x @ w_dense.T``, planned only where the plans were timed with the shadow (below every w4a16 tile).
DENSE = -100
#: A plan's value for "through a transient dequantized weight" (``dequant_matmul``): ``x @ dequantize(w).T``,
#: one projection at a time, planned from ``dequant_matmul.MIN_ROWS`` rows where it measured cheaper.
DEQUANT = -200


def tile(to: int) -> int | None:
    """The w4a16 tile (an index of ``w4a16.TILES``) a plan value sends rows to: ``MMA`` is tile 0,
    ``MMA - i`` tile ``i``; ``None`` for a value that is not the kernel."""
    return MMA - to if DENSE < to <= MMA else None


#: Row counts above ``calibrate_rows`` timed for ``MMA`` (and ``DENSE``, ``DEQUANT``); a row count between
#: them takes the plan of the next one up (the largest one's beyond it). Their plans are one of those or
#: the row count (flattened).
LARGE_ROWS = (32, 64, 128, 256)


def large_rows(max_batch: int | None = None) -> tuple[int, ...]:
    """The ``LARGE_ROWS`` a decode step of at most ``max_batch`` sequences can reach: those below it and
    the first at or above it (``None``: all). A daemon of 32 sequences times no plan for 64-256 rows."""
    if max_batch is None:
        return LARGE_ROWS
    below = tuple(r for r in LARGE_ROWS if r < max_batch)
    return below + tuple(r for r in LARGE_ROWS if r >= max_batch)[:1]


#: Projection modules (by id) whose one-row calls (classic B = 1 decode) are planned to ``KERNEL``.
one_row: set[int] = set()
#: Counts ``install`` calls: what was derived from the plans (``projections.together``) is stale once it moves.
generation = 0

RowKernel = Callable[[mx.array], "mx.array | None"]
#: The w4a16 kernel on flattened rows with a tile (``tile``); ``None`` where it does not take them.
TileKernel = Callable[[mx.array, int], "mx.array | None"]


def lookup(plan: dict[int, int], rows: int) -> int:
    """The rows of the kernel call for ``rows`` rows under ``plan``: its own entry, else the plan of the
    next ``LARGE_ROWS`` count up (the largest one's beyond them): ``MMA``, ``DENSE``, ``DEQUANT`` or the rows
    flattened."""
    to = plan.get(rows)
    if to is not None:
        return to
    large = [r for r in LARGE_ROWS if r in plan]
    if not large or rows == 1:  # a plan holds every other row count up to the calibrated ones
        return rows
    bucket = next((r for r in large if r >= rows), large[-1])
    to = plan[bucket]
    return to if tile(to) is not None or to in (DENSE, DEQUANT) else rows


def project(
    call: Callable[[mx.array], mx.array],
    x: mx.array,
    rows: int,
    key: int = 0,
    kernel: RowKernel | None = None,
    mma: TileKernel | None = None,
    dense: RowKernel | None = None,
    dequant: RowKernel | None = None,
) -> tuple[mx.array, int]:
    """``call(x)`` through the batched path; returns the output and the rows of the kernel call.

    ``kernel`` computes flattened rows through the project's multi-row kernel (``None`` where that
    does not take them): used where the plan says ``KERNEL``. ``mma`` likewise through the w4a16
    kernel, with the plan's tile, where the plan says ``MMA`` or a value below and ``x`` is a decode step's (one token a sequence: a forward
    calls each projection once, which the kernel's per-weight counters need). A single row (classic
    B = 1 decode) is left exactly as mlx-lm calls it unless its plan is ``KERNEL``. ``dense`` computes
    flattened rows through the dequantized shadow where the plan says ``DENSE`` (decode steps and
    prefill alike: a plain matmul); ``dequant`` likewise through a transient dequantized weight where it
    says ``DEQUANT``; where they do not take them, the rows run flattened.
    """
    if x.ndim < 2 or not active().flatten:
        return call(x), rows
    plan = _plans.get(key)
    to = rows if plan is None else lookup(plan, rows)
    if to in (DENSE, DEQUANT):
        way = dense if to == DENSE else dequant
        out = None if way is None else way(x.reshape(rows, x.shape[-1]))
        if out is not None:
            return out.reshape(*x.shape[:-1], out.shape[-1]), rows
        to = rows
    mma_tile = tile(to)
    if mma_tile is not None:
        decode = x.ndim == 3 and x.shape[1] == 1
        out = mma(x.reshape(rows, x.shape[-1]), mma_tile) if mma is not None and decode else None
        if out is not None:
            return out.reshape(*x.shape[:-1], out.shape[-1]), rows
        to = rows
    if to == KERNEL:
        out = None if kernel is None else kernel(x.reshape(rows, x.shape[-1]))
        if out is not None:
            return out.reshape(*x.shape[:-1], out.shape[-1]), rows
        to = rows
    if to == 0 or rows == 1:
        return call(x), rows
    flat = padded_rows(x, rows, to) if to != rows else x.reshape(rows, x.shape[-1])
    out = call(flat)
    if to != rows:
        out = out[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1]), to


#: The last input padded for a call: (that input, the rows it was padded to, the padded rows). A
#: layer's q/k/v (and gate/up) are called on one input one after another, so it is padded once for
#: them: each padding is a concatenation and a slice, which added up to a visible share of a small
#: batch's step when every projection paid its own.
_last_pad: tuple[mx.array, int, mx.array] | None = None


def padded_rows(x: mx.array, rows: int, to: int) -> mx.array:
    """``x``'s rows flattened and padded with zero rows to ``to``, made once per input and size."""
    global _last_pad
    last = _last_pad
    if last is not None and last[0] is x and last[1] == to:
        return last[2]
    out = _pad(x.reshape(rows, x.shape[-1]), to)
    _last_pad = (x, to, out)
    return out


def _pad(flat: mx.array, to: int) -> mx.array:
    return mx.concatenate([flat, mx.zeros((to - flat.shape[0], flat.shape[1]), dtype=flat.dtype)], axis=0)


#: Row counts a call may be padded to (besides its own).
PADS = (8, 16)


def _projections(model: nn.Module) -> list[tuple[nn.Module, str]]:
    out: list[tuple[nn.Module, str]] = []
    for _, m in model.named_modules():
        if isinstance(m, nn.Linear | nn.QuantizedLinear):
            out.append((m, f"{type(m).__name__}{tuple(m.weight.shape)}/{getattr(m, 'bits', None)}"))
    return out


def install(model: nn.Module, by_shape: dict[str, dict[int, int]]) -> None:
    """Route ``model``'s projections by ``by_shape`` (each module shares its shape's plan)."""
    global generation
    generation += 1
    for m, shape in _projections(model):
        one_row.discard(id(m))
        if by_shape[shape].get(1) == KERNEL:
            one_row.add(id(m))
        if id(m) not in _plans:
            # Keyed by id: a dead module's entry must go with it, or a later module that Python
            # gives the same id would inherit a plan timed for another shape (and policy).
            weakref.finalize(m, _forget, id(m))
        _plans[id(m)] = by_shape[shape]


def installed(model: nn.Module) -> dict[str, str]:
    """The plans installed for ``model``'s projections (``plans_summary`` lines; empty when none):
    part of what a verdict depends on, since a plan decides which kernel a batched wide forward runs."""
    by_shape = {shape: _plans[id(m)] for m, shape in _projections(model) if id(m) in _plans}
    return plans_summary(by_shape)


def planned(key: int, rows: int) -> int | None:
    """The rows of module ``key``'s call on ``rows`` rows (``KERNEL``: the project's kernel; ``None``
    where no plan is installed)."""
    if rows == 1:
        return KERNEL if key in one_row else None
    plan = _plans.get(key)
    return None if plan is None else lookup(plan, rows)


def _forget(key: int) -> None:
    global generation
    generation += 1
    _plans.pop(key, None)
    one_row.discard(key)


def plans_summary(by_shape: dict[str, dict[int, int]]) -> dict[str, str]:
    """``calibrate``'s plans as one line per shape, for stats and benchmark records: each row count
    with the rows its kernel call runs on (``0``: as mlx-lm calls it; ``k``: the project's multi-row
    kernel; ``m``: the w4a16 tensor-core kernel, ``m1``, ``m2``...: with that tile of ``w4a16.TILES``;
    ``d``: the dequantized shadow, ``q``: a transient dequantized weight),
    e.g. ``"1:k 2:k 3:0 ... 9:16 ... 16:m 32:m ... 256:q"``."""

    def name(to: int) -> str:
        t = tile(to)
        if t is not None:
            return f"m{t or ''}"
        return {KERNEL: "k", DENSE: "d", DEQUANT: "q"}.get(to, str(to))

    return {
        shape: " ".join(f"{rows}:{name(to)}" for rows, to in sorted(plan.items())) for shape, plan in by_shape.items()
    }


def attention_inputs(keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """K/V as the fused attention should see them (a single sequence's contiguous where the backend needs it)."""
    if active().contiguous_kv and isinstance(keys, mx.array) and keys.shape[0] == 1:
        return mx.contiguous(keys), mx.contiguous(values)
    return keys, values
