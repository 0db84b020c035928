"""Decode's own quantized matrix-vector arithmetic, run on several rows in one pass over the weights.

Why: a verify block is exact when each of its rows is computed as classic decode computes that row.
On MLX CUDA classic decode's quantized projections run MLX's one-row kernel (``qmv``): one warp
per output feature, each lane dequantizing 16 (4-bit) or 8 (8-bit) weights at a time with cutlass's
array arithmetic in the activation dtype (scale multiply, bias add, fused multiply-add into one
accumulator per element; fp32 accumulators for 8-bit), then the lane's accumulators summed in fp32
in element order and the warp's lanes in a butterfly. This kernel performs that same sequence of
operations, through the same cutlass headers, for up to ``MAX_ROWS`` rows at once, sharing each
dequantized weight tile between the rows. If it reproduces MLX's one-row results byte for byte,
the ``mirrored`` level verifies a block at about one weight pass *without* pinning classic decode
(unlike ``rowwise``, whose one-row results are its own).

Whether it does is measured, never assumed: MLX's kernel choice and arithmetic are MLX's to change.
Every layer shape (out, in, bits, group size, dtype) is checked at first use against MLX's own
one-row call on random rows (``_matches``); a shape that differs in any byte (or a kernel that does
not compile) falls back to decode's own one-row call per row, which is exact by construction, and
the probe then verifies the level end to end like any other.

A layer's projections that take the same input (q/k/v, gate/up: ``register_siblings``) run in one
call over their weight matrices: each warp works in one matrix, on the outputs and with the
arithmetic it has in that matrix's own call, so the outputs are unchanged, and a 32-layer block makes
4 kernel calls a layer instead of 7 (fewer launches, and less graph building in Python). Each group's
shapes are checked against MLX's one-row call like a single layer's.

Because each row is MLX's one-row call, batched forwards may use the kernel too where it is cheaper
(``fastpath.KERNEL``: 1-8 rows, classic decode's one row included), without changing a byte; where
every sibling of a group is planned to it at a row count, they share one call there as well
(``projections.together``).

The CUDA text is ``workers.kernels.qmv_source``; this module checks, plans and launches it.

Switch: ``rowkernel.implementation()`` (``MLX_BATCHD_ROWKERNEL``). With ``reference`` (CPU tests)
every row takes the fallback, so tests exercise the level's plumbing; the kernel itself can only
be checked where MLX runs on CUDA (``benchmarks/rowkernel_probe.py``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from workers.api import MAX_ROWS
from workers.kernels import jit_cache, qmv_launch, qmv_source, rowkernel
from workers.kernels.byte_equal import bytes_equal

log = logging.getLogger("mlx_batchd.qmv_rows")


#: The module types the kernel may take (``covered`` says which of them it does).
_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)
#: Kernels by number of weight matrices per call.
_kernels: dict[int, Any] = {}
#: Per layer shapes (one, or a sibling group's) and dtype: whether the kernel reproduced MLX's one-row call.
_matches_mlx: dict[tuple[Any, ...], bool] = {}
#: Whether the kernel compiled (``None`` until first tried).
_compiled: bool | None = None
#: The start-up check (``usable``): ``None`` until run.
_checked: bool | None = None
#: Projections of one layer that the model calls on the same input, computed in one kernel call.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: id(module) -> its sibling group (weak references, in ``SIBLINGS`` order).
_siblings: dict[int, tuple[weakref.ref[Any], ...]] = {}
#: id(module) -> (the input it was computed on, its output), kept by a sibling's call until its own.
_kept: dict[int, tuple[Any, mx.array]] = {}


@dataclass(frozen=True)
class _Ready:
    """Modules (one, or a sibling group) the kernel was checked on, with what their calls need."""

    modules: tuple[weakref.ref[Any], ...]
    dtype: Any
    mats: list[tuple[mx.array, mx.array, mx.array]]
    bits: int
    gs: int
    #: Each module's bias, or ``None`` where no module has one.
    biases: list[Any] | None

    def serves(self, modules: tuple[Any, ...], x: mx.array) -> bool:
        """Whether these are still the checked modules with the checked weight arrays, on rows of
        the checked dtype."""
        if x.dtype != self.dtype:
            return False
        for ref, m, (w, s, _) in zip(self.modules, modules, self.mats, strict=True):
            if m["weight"] is not w or m["scales"] is not s or ref() is not m:
                return False
        return True


#: Module ids (one, or a sibling group's) -> what the kernel was checked on: later calls (every
#: forward's projections) skip the checks and the shape keys, which cost a verify block's graph
#: building about as much as MLX's own calls do. Used only while the modules and their weight arrays
#: are the ones checked.
_ready: dict[tuple[int, ...], _Ready] = {}


def covered(module: Any, x: mx.array) -> tuple[mx.array, mx.array, mx.array, int, int] | None:
    """(weight, scales, biases, bits, group size) when the kernel takes ``module`` on rows like ``x``:
    an affine 4- or 8-bit ``QuantizedLinear`` (or a tied embedding's linear use) with bf16 or fp16
    activations and scales of the same dtype, 2-D rows, in features a multiple of one lane's tile."""
    if not isinstance(module, _QUANTIZED) or x.ndim != 2:
        return None
    biases = module.get("biases")
    if getattr(module, "mode", "affine") != "affine" or biases is None or module.bits not in (4, 8):
        return None
    scales = module["scales"]
    if x.dtype not in (mx.bfloat16, mx.float16) or scales.dtype != x.dtype or x.shape[1] % 16:
        return None
    return module["weight"], scales, biases, int(module.bits), int(module.group_size)


def _kernel(count: int) -> Any:
    """The kernel over ``count`` weight matrices (made once per count)."""
    kernel = _kernels.get(count)
    if kernel is None:
        if count == 1:
            names, outs, source = ["x", "w", "scales", "biases"], ["out"], qmv_source.ONE + qmv_source.BODY
        else:
            names = ["x", *(f"{n}{j}" for j in range(count) for n in ("w", "scales", "biases"))]
            outs, source = [f"out{j}" for j in range(count)], qmv_source.many(count) + qmv_source.BODY
        kernel = _kernels[count] = jit_cache.cuda_kernel(
            name=f"mlx_batchd_qmv_rows_{count}",
            input_names=names,
            output_names=outs,
            source=source,
            header=qmv_source.HEADER,
        )
    return kernel


class Mats(list[tuple[mx.array, mx.array, mx.array]]):
    """A checked group's (weight, scales, biases) triples, with its launch arguments by (rows, outputs
    per warp, tiles ahead, dtype): a verify block calls each group once per layer, and working the
    arguments out again on every call was a third of a call's Python."""

    __slots__ = ("plans",)

    def __init__(self, mats: list[tuple[mx.array, mx.array, mx.array]]) -> None:
        super().__init__(mats)
        self.plans: dict[tuple[Any, ...], tuple[Any, list[mx.array], dict[str, Any]]] = {}


def _plan(
    m: int, r: int, mats: list[tuple[mx.array, mx.array, mx.array]], bits: int, gs: int, dtype: Any
) -> tuple[Any, list[mx.array], dict[str, Any]]:
    """The kernel, the inputs after ``x`` and the launch arguments of a call on ``m`` rows."""
    w = qmv_launch.warps(m)
    blocks = -(-sum(-(-int(mat[0].shape[0]) // r) for mat in mats) // w)
    kwargs = {
        "template": [("T", dtype), ("M", m), ("GS", gs), ("BITS", bits), ("R", r), ("U", qmv_launch.unroll(m))],
        "grid": (blocks * w * 32, 1, 1),
        "threadgroup": (w * 32, 1, 1),
        "output_shapes": [(m, int(mat[0].shape[0])) for mat in mats],
        "output_dtypes": [dtype] * len(mats),
    }
    return _kernel(len(mats)), [a for mat in mats for a in mat], kwargs


def _launch(x: mx.array, mats: list[tuple[mx.array, mx.array, mx.array]], bits: int, gs: int) -> list[mx.array]:
    """``x``'s rows (at most ``MAX_ROWS``) against each (weight, scales, biases) in one kernel call
    (its launch arguments kept on ``mats`` where it is a checked group's ``Mats``)."""
    m = x.shape[0]
    r = qmv_launch.per_warp(m)
    plans = getattr(mats, "plans", None)
    key = (m, r, qmv_launch.warps(m), qmv_launch.unroll(m), x.dtype)
    plan = None if plans is None else plans.get(key)
    if plan is None:
        plan = _plan(m, r, mats, bits, gs, x.dtype)
        jit_cache.prime(plan[0], [x, *plan[1]], plan[2]["template"], plan[2]["output_dtypes"])
        if plans is not None:
            plans[key] = plan
    kernel, tail, kwargs = plan
    return kernel(inputs=[x, *tail], **kwargs)


def _matches(
    modules: tuple[Any, ...], original: Callable[..., mx.array], found: list[tuple[Any, ...]], dtype: Any
) -> bool:
    """The kernel over ``modules`` (one, or siblings in one call) on 5 random rows and on each row
    alone, against MLX's own one-row call of each module on each row, byte for byte (the call
    ``original`` makes for classic decode)."""
    global _compiled
    w, s, b, bits, gs = found[0]
    k = int(s.shape[1]) * gs
    mats = [(f[0], f[1], f[2]) for f in found]
    x = (mx.random.normal((5, k), key=mx.random.key(k + int(w.shape[0]))) * 0.5).astype(dtype)
    try:
        five = _launch(x, mats, bits, gs)
        ones = [_launch(x[i : i + 1], mats, bits, gs) for i in range(5)]
        mlx_rows = [[original(module, x[i : i + 1]) for i in range(5)] for module in modules]
        mx.eval(five, ones, mlx_rows)
        _compiled = True
    except Exception as exc:
        if len(modules) > 1:  # the group's layers then run one call each
            log.warning("the mirrored kernel over %d matrices is unavailable: %s", len(modules), exc)
            return False
        log.warning("the mirrored kernel is unavailable: %s", exc)  # every shape on the fallback
        _compiled = False
        return False
    return all(
        bytes_equal(five[j][i : i + 1], mlx_rows[j][i]) and bytes_equal(ones[i][j], mlx_rows[j][i])
        for j in range(len(modules))
        for i in range(5)
    )


def usable() -> bool:
    """Whether the level can run here: ``rowkernel``'s switch selects an implementation and, for the
    CUDA kernel, it compiled and reproduced MLX's one-row call on a small random 4-bit layer at first
    use (fail closed: otherwise the ladder goes without ``mirrored``)."""
    global _checked
    impl = rowkernel.implementation()
    if impl != "cuda":
        return impl is not None
    if _checked is None:
        module = nn.QuantizedLinear(512, 64, bits=4, group_size=64)
        module.set_dtype(mx.bfloat16)
        call = type(module).__call__
        original = getattr(call, "__wrapped__", call)
        found = covered(module, mx.zeros((1, 512), dtype=mx.bfloat16))
        _checked = found is not None and _matches((module,), original, [found], mx.bfloat16)
        if not _checked:
            log.warning("the mirrored kernel does not reproduce MLX's one-row call: the level is off")
    return _checked


def register_siblings(model: Any) -> int:
    """Note each layer's projections that take the same input (``SIBLINGS``: q/k/v, gate/up), so that
    the first of them called at ``mirrored`` computes them all in one kernel call; returns the
    number of groups. Kept as weak references: a model that goes away takes its groups with it."""
    count = 0
    for _, parent in model.named_modules():
        for names in SIBLINGS:
            found = [parent.get(n) for n in names] if isinstance(parent, dict) else []
            members = [m for m in found if isinstance(m, nn.QuantizedLinear)]
            if len(members) < 2 or len({(int(m["scales"].shape[1]), m.bits, m.group_size) for m in members}) > 1:
                continue
            refs = tuple(weakref.ref(m) for m in members)
            for m in members:
                _siblings[id(m)] = refs
            count += 1
    return count


def siblings(module: Any) -> tuple[Any, ...] | None:
    """``module``'s sibling group (itself included), or ``None`` when it has none (or when a module
    that had ``module``'s id is gone and another now has it). Called for every projection of a
    verify block: kept to a few C-level calls."""
    refs = _siblings.get(id(module))
    if refs is None:
        return None
    members = tuple([r() for r in refs])
    for m in members:
        if m is None:
            return None
        if m is module:
            return members
    return None


def _through(modules: tuple[Any, ...], original: Callable[..., mx.array], x: mx.array) -> list[mx.array] | None:
    """Each module's projection of ``x``'s rows through the kernel (all in one call per ``MAX_ROWS``
    rows), or ``None`` where a module, its shape or this backend is not covered."""
    ids = tuple(map(id, modules))
    ready = _ready.get(ids)
    if ready is None or not ready.serves(modules, x):
        # The switch is read here, on a miss, not on every call: a checked group was checked under it.
        if rowkernel.implementation() != "cuda":
            return None
        ready = _check(modules, original, x)
        if ready is None:
            return None
        _ready[ids] = ready
    mats, bits, gs = ready.mats, ready.bits, ready.gs
    if x.shape[0] <= MAX_ROWS:
        outs = _launch(x, mats, bits, gs)
    else:
        parts = [_launch(x[i : i + MAX_ROWS], mats, bits, gs) for i in range(0, x.shape[0], MAX_ROWS)]
        outs = [mx.concatenate(list(p), axis=0) for p in zip(*parts, strict=True)]
    if ready.biases is None:
        return outs
    return [o if b is None else o + b for o, b in zip(outs, ready.biases, strict=True)]


def _check(modules: tuple[Any, ...], original: Callable[..., mx.array], x: mx.array) -> _Ready | None:
    """The modules' kernel inputs where the kernel takes them and reproduced MLX's one-row call on
    their shapes (checked once per shape group), else ``None``."""
    found = [covered(m, x) for m in modules]
    if any(f is None for f in found):
        return None
    mats = [(f[0], f[1], f[2]) for f in found]  # type: ignore[index]
    bits, gs = found[0][3], found[0][4]  # type: ignore[index]
    key = (tuple((tuple(w.shape), tuple(s.shape)) for w, s, _ in mats), bits, gs, str(x.dtype))
    ok = _matches_mlx.get(key)
    if ok is None:
        ok = _matches_mlx[key] = _matches(modules, original, found, x.dtype)  # type: ignore[arg-type]
        log.info("mirrored kernel on %s: %s", key, "matches MLX's one-row call" if ok else "differs; one-row calls")
    if not ok:
        return None
    found_biases = [m["bias"] if isinstance(m, nn.QuantizedLinear) and "bias" in m else None for m in modules]
    biases = None if all(b is None for b in found_biases) else found_biases
    return _Ready(tuple(weakref.ref(m) for m in modules), x.dtype, Mats(mats), bits, gs, biases)


def project(module: Any, original: Callable[..., mx.array], x: mx.array, source: Any = None) -> mx.array | None:
    """``module``'s projection of ``x``'s rows (shape (rows, in)) through the kernel, in calls of at
    most ``MAX_ROWS`` rows, or ``None`` where the module, its shape or this backend is not covered
    (the caller then makes decode's own one-row call per row).

    ``source`` is the array the model called the module with: when the module has siblings
    (``register_siblings``) the first of them called on it computes them all in one call and keeps the
    others' outputs for their own calls on that same array (taken first: only the kernel made them)."""
    if not isinstance(module, _QUANTIZED):  # dense layers: ``gemv_rows``
        return None
    if source is not None:
        kept = _kept.pop(id(module), None)
        if kept is not None and kept[0] is source:
            return kept[1]
    if _compiled is False:
        return None
    if source is None:
        return _one(module, original, x)
    group = siblings(module)
    if group is not None:
        outs = _through(group, original, x)
        if outs is not None:
            mine = outs[0]
            for m, o in zip(group, outs, strict=True):
                if m is module:
                    mine = o
                else:
                    _kept[id(m)] = (source, o)
            return mine
    return _one(module, original, x)


def _one(module: Any, original: Callable[..., mx.array], x: mx.array) -> mx.array | None:
    outs = _through((module,), original, x)
    return None if outs is None else outs[0]


def report() -> dict[str, bool]:
    """Which layer shapes (one, or a sibling group's) the kernel reproduced MLX's one-row call on."""
    return {repr(k): v for k, v in _matches_mlx.items()}
