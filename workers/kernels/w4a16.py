"""A w4a16 tensor-core GEMM for batched decode's 4-bit projections on MLX CUDA.

``y = x @ dequantize(w).T`` for bf16 (or float16) activations ``x`` [M, K] and a ``QuantizedLinear``'s own
arrays (4-bit affine, group 32, 64 or 128, scales and biases of the activations' dtype: no second copy of
the weights). MLX's quantized
matmul at 16-256 rows fills few SMs and a decode forward runs its projections one after another, so
it waits on each; this kernel dequantizes in registers (MLX's dequantize bit for bit) and feeds
``mma.sync.m16n8k16`` with fp32 accumulators, splitting K across CTAs until the SMs are busy and
adding the slices in a fixed order (deterministic). The CUDA text is ``w4a16_source``.

Where it runs, and with which tile (``TILES``), is a plan value (``fastpath.MMA`` and the values below
it), chosen per projection shape and row count by ``plan_timing`` on the machine; MLX's kernels stay the fallback, and ``MLX_BATCHD_W4A16=0`` takes the
kernel out of the plans. Its dequantization is one FMA a pair, as MLX CUDA's ``scale * q + bias``
compiles, so its error matches MLX's own (``tests/gpu``); each launch plan's first call on a weight
shape is compared with MLX's dense product of the dequantized weight on seeded random rows, and MLX's
kept there if it is off (fail closed). Batched decode makes no byte-identity promise; the exact levels
never reach this kernel.

Each weight has one int32 counter an output column for the split-K reduction (zero between
launches: the last CTA of a tile resets its own). Two launches on one weight must therefore not run
at once: ``fastpath.project`` sends only decode steps (one token a sequence) here, where a forward
calls each projection once and steps follow one another.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from workers import envs
from workers.kernels import jit_cache
from workers.kernels.w4a16_source import (
    NATIVE_HEADER,
    NATIVE_INPUT_NAMES,
    NATIVE_SOURCE,
    OUTPUT_NAMES,
    REGISTER_CAPS,
    TILES,
)

log = logging.getLogger("mlx_batchd")

#: Streaming multiprocessors assumed when MLX does not say (H100 SXM and H200: 132).
DEFAULT_SMS = 132
#: Group sizes the kernel takes (a k16 MMA step never straddles a group).
GROUP_SIZES = (32, 64, 128)
#: Dynamic shared memory a launch may take without opting in to more.
SHARED_LIMIT = 48000
#: The activations' (and scales' and biases') dtypes it takes: bf16, and float16 (a GGUF model's on a GPU).
DTYPES = (mx.bfloat16, mx.float16)
#: A launch plan's first call on a weight shape is compared with MLX's dense product of the dequantized
#: weight (float32 accumulation, as the kernel's) on seeded random rows: off by more than this fraction
#: of that product's largest output, MLX's call is kept there. Two right products differ by a few ulps of the outputs (2^-8 each in
#: bf16); a wrong nibble, scale or index is off by the outputs' own size. (MLX's quantized matmul is no
#: reference here: on the CPU it accumulates in bf16, a fifth of the largest output off at K = 14336.)
TOLERANCE = 2.0**-5


def sms() -> int:
    """The default device's streaming multiprocessors (``DEFAULT_SMS`` where MLX does not report them)."""
    try:
        info = mx.device_info()
    except Exception:  # a backend without device info
        return DEFAULT_SMS
    for key in ("multi_processor_count", "num_sms", "sm_count"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_SMS


@dataclass(frozen=True)
class Plan:
    """One launch: ``mt`` 16-row tiles and ``nb`` 16-output blocks a warp, ``warps`` a CTA, ``splits`` K
    slices (their partials added by the last CTA of a tile when ``reduce``, else by an MLX sum after
    it), ``stages`` k64 steps of cp.async in flight (2-4), ``regs`` a thread's register cap (0: the
    compiler's choice; a lower cap fits more CTAs on an SM)."""

    mt: int
    nb: int
    warps: int
    splits: int
    reduce: bool = True
    stages: int = 4
    regs: int = 0

    def tiles(self, m: int, n: int) -> int:
        """CTAs a K slice (the counters the in-kernel reduction uses)."""
        gx, gy, _ = self.grid(m, n)
        return gx // (32 * self.warps) * gy

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        """The launch grid in threads (``mx.fast.cuda_kernel`` counts threads along x)."""
        row_tiles = -(-m // (16 * self.mt))
        n_ctas = -(-(n // 16) // (self.nb * self.warps))
        return row_tiles * 32 * self.warps, n_ctas, self.splits

    def native_shared_bytes(self) -> int:
        """Dynamic shared memory: ``stages`` k64 steps of activations (``16 * mt`` rows of 64 bf16) and
        of MLX's packed weights (the CTA's outputs, 8 words each)."""
        return self.stages * (self.mt * 16 * 128 + self.nb * self.warps * 16 * 32)


def plan(
    m: int,
    n: int,
    k: int,
    mt: int | None = None,
    nb: int | None = None,
    warps: int | None = None,
    splits: int | None = None,
    ctas_per_sm: float | None = None,
    reduce: bool = True,
    stages: int | None = None,
    sm_count: int = DEFAULT_SMS,
    regs: int | None = None,
    min_steps: int = 2,
) -> Plan:
    """The tile for ``m`` rows (any field may be forced): 16/32/64-row tiles, two 16-output blocks a
    warp, four warps, and as many K slices as it takes to give every SM about ``ctas_per_sm`` CTAs (4
    for 16-row tiles, 2 for larger), at least ``min_steps`` k64 steps a slice; ``stages`` the deepest pipeline
    that fits ``SHARED_LIMIT``; ``regs`` the tile's cap in ``REGISTER_CAPS`` (none: 0)."""
    if mt is None:
        mt = 1 if m <= 16 else 2 if m <= 32 else 4
    nb = 2 if nb is None else nb
    warps = 4 if warps is None else warps
    if splits is None:
        if ctas_per_sm is None:
            ctas_per_sm = 4.0 if mt == 1 else 2.0
        ctas = -(-m // (16 * mt)) * -(-(n // 16) // (nb * warps))
        target = ctas_per_sm * sm_count
        splits = 1 if ctas >= target / 2 else math.ceil(target / ctas)
        splits = max(1, min(splits, k // 64 // max(1, min_steps), 64))
    if stages is None:
        fits = (st for st in (4, 3) if Plan(mt, nb, warps, 1, stages=st).native_shared_bytes() <= SHARED_LIMIT)
        stages = next(fits, 2)
    regs = REGISTER_CAPS.get((mt, nb, warps), 0) if regs is None else regs
    return Plan(mt, nb, warps, max(1, min(splits, k // 64)), reduce, max(2, stages), regs)


@functools.lru_cache(maxsize=4096)
def tile_plan(m: int, n: int, k: int, tile: int = 0) -> Plan:
    """``plan`` for ``m`` rows on this device with ``TILES[tile]``'s fields forced."""
    t = TILES[tile]
    return plan(m, n, k, mt=t.mt, nb=t.nb, reduce=t.reduce, sm_count=sms(), min_steps=t.min_steps)


def check_shapes(n: int, k: int, group_size: int) -> None:
    """Raise ``ValueError`` for a shape the kernel does not take."""
    if group_size not in GROUP_SIZES or k % 64 or k % group_size or n % 16:
        raise ValueError(
            f"w4a16: needs N % 16 == 0, K % 64 == 0, group in {GROUP_SIZES}; got N={n} K={k} gs={group_size}"
        )


def available() -> bool:
    """Whether the kernel can run here: MLX's CUDA backend on the default device."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


@dataclass(frozen=True)
class Native:
    """A weight as MLX holds it (``mx.quantize``'s arrays, untouched) plus one int32 counter an output
    (the in-kernel reduction's; zero between launches)."""

    w: mx.array
    scales: mx.array
    biases: mx.array
    locks: mx.array
    group_size: int

    @property
    def n(self) -> int:
        return self.w.shape[0]

    @property
    def k(self) -> int:
        return self.w.shape[1] * 8

    @property
    def nbytes(self) -> int:
        """What the weight holds in memory: MLX's arrays plus the counters (4 bytes an output)."""
        return self.w.nbytes + self.scales.nbytes + self.biases.nbytes + self.locks.nbytes


def native(w: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64) -> Native:
    """MLX's 4-bit arrays and the reduction counters: what ``native_matmul`` takes (no copy)."""
    check_shapes(w.shape[0], w.shape[1] * 8, group_size)
    if scales.dtype not in DTYPES or biases.dtype != scales.dtype:
        raise ValueError("w4a16: needs bf16 or float16 scales and biases of one dtype")
    return Native(w, scales, biases, mx.zeros((w.shape[0],), dtype=mx.int32), group_size)


@dataclass(frozen=True)
class Kernel:
    """What a layout's kernel is built from: its name's tag, the template argument that sets its
    pipeline depth and the plan's value of it, the dynamic shared memory a plan takes, its inputs
    and its text."""

    tag: str
    depth: str
    depth_of: Callable[[Any], int]
    shared_bytes: Callable[[Any], int]
    input_names: list[str]
    source: str
    header: str


NATIVE = Kernel(
    "w4n",
    "STAGES",
    lambda p: p.stages,
    lambda p: p.native_shared_bytes(),
    NATIVE_INPUT_NAMES,
    NATIVE_SOURCE,
    NATIVE_HEADER,
)

_kernels: dict[str, Any] = {}


def kernel_name(kern: Kernel, p: Plan, gs: int, split: bool, reduce: bool, dtype: mx.Dtype = mx.bfloat16) -> str:
    """One name a variant (MLX caches compiled kernels by name)."""
    dt = "" if dtype == mx.bfloat16 else "_f16"
    return (
        f"mlx_batchd_{kern.tag}_{p.mt}_{p.nb}_{p.warps}_{kern.depth_of(p)}_{gs}_{int(split)}{int(reduce)}_r{p.regs}{dt}"
    )


def template(
    kern: Kernel, p: Plan, gs: int, split: bool, reduce: bool, dtype: mx.Dtype = mx.bfloat16
) -> list[tuple[str, Any]]:
    """The kernel's template arguments for a plan (``dtype``: the activations')."""
    return [
        ("T", dtype),
        ("MT", p.mt),
        ("NB", p.nb),
        ("WARPS", p.warps),
        (kern.depth, kern.depth_of(p)),
        ("GS", gs),
        ("SPLIT", split),
        ("REDUCE", reduce),
        (jit_cache.REGISTER_CAP, p.regs),
    ]


def _kernel(kern: Kernel, p: Plan, gs: int, split: bool, reduce: bool, dtype: mx.Dtype) -> Any:
    name = kernel_name(kern, p, gs, split, reduce, dtype)
    built = _kernels.get(name)
    if built is None:
        built = _kernels[name] = jit_cache.cuda_kernel(
            name=name,
            input_names=kern.input_names,
            output_names=OUTPUT_NAMES,
            source=kern.source,
            header=kern.header,
            shared_memory=kern.shared_bytes(p),
        )
    return built


def launch(
    kern: Kernel, x: mx.array, n: int, k: int, group_size: int, arrays: list[mx.array], locks: mx.array, p: Plan | None
) -> mx.array:
    """Check the shapes, plan, launch ``kern`` on ``[x, *arrays, locks]``; [M, N] in ``x``'s dtype."""
    if x.dtype not in DTYPES or x.ndim != 2:
        raise ValueError("w4a16: 2-D bf16 or float16 activations only")
    if any(a.dtype not in (mx.uint32, x.dtype) for a in arrays):
        raise ValueError("w4a16: the scales and biases must have the activations' dtype")
    m = x.shape[0]
    check_shapes(n, k, group_size)
    if x.shape[1] != k:
        raise ValueError(f"w4a16: x has K={x.shape[1]}, the weight {k}")
    if m == 0:
        return mx.zeros((0, n), dtype=x.dtype)
    p = p or tile_plan(m, n, k)
    split = p.splits > 1
    reduce = split and p.reduce and p.tiles(m, n) <= locks.size
    dt = x.dtype
    kernel, args = _kernel(kern, p, group_size, split, reduce, dt), template(kern, p, group_size, split, reduce, dt)
    jit_cache.prime(kernel, [x, *arrays, locks], args, [dt, mx.float32])
    out, ws = kernel(
        inputs=[x, *arrays, locks],
        template=args,
        grid=p.grid(m, n),
        threadgroup=(32 * p.warps, 1, 1),
        output_shapes=[(m, n), (p.splits, m, n) if split else (1,)],
        output_dtypes=[dt, mx.float32],
    )
    if split and not reduce:
        return ws.sum(axis=0).astype(dt)
    return out


def native_matmul(x: mx.array, w: Native, p: Plan | None = None) -> mx.array:
    """``x @ dequantize(w).T`` straight from MLX's packed arrays (``native``); [M, N] in ``x``'s dtype."""
    if p is not None and not 2 <= p.stages <= 4:
        raise ValueError(f"w4a16: 2-4 stages, got {p.stages}")
    return launch(NATIVE, x, w.n, w.k, w.group_size, [w.w, w.scales, w.biases], w.locks, p)


# --------------------------------------------------------------------------- projection modules

#: Per ``QuantizedLinear`` (by id): its weight as the kernel takes it, made at first use.
_weights: dict[int, Native] = {}
#: Test seam: when set, runs in place of the CUDA launch (``(x, weight, plan) -> y``); the kernel cannot
#: run on a machine without CUDA, so the routing around it is tested through this.
launch_seam: Callable[[mx.array, Native, Plan], mx.array] | None = None


def takes(m: nn.Module) -> bool:
    """Whether the kernel takes ``m`` here: a 4-bit affine ``QuantizedLinear`` of a shape it runs,
    bf16 or float16 scales and biases, on a backend where it runs (or with ``launch_seam`` set), unless
    switched off (``MLX_BATCHD_W4A16=0``)."""
    if envs.switch(envs.W4A16) is False:
        return False
    if not isinstance(m, nn.QuantizedLinear) or m.bits != 4 or getattr(m, "mode", "affine") != "affine":
        return False
    biases = getattr(m, "biases", None)
    if biases is None or m.scales.dtype not in DTYPES or biases.dtype != m.scales.dtype:
        return False
    n, k = m.weight.shape[0], m.weight.shape[1] * 8
    if m.group_size not in GROUP_SIZES or k % 64 or k % m.group_size or n % 16:
        return False
    return launch_seam is not None or available()


def _weight(m: nn.QuantizedLinear) -> Native:
    w = _weights.get(id(m))
    if w is None or w.w is not m.weight:  # new weights loaded into the module: new counters too
        if w is None:
            weakref.finalize(m, _weights.pop, id(m), None)
        assert m.biases is not None
        w = _weights[id(m)] = native(m.weight, m.scales, m.biases, m.group_size)
    return w


#: ``takes`` by module id, for ``project``'s check on every call.
_takes: dict[int, bool] = {}
#: (N, K, group size, dtype, launch plan) -> whether the first call of that launch on that weight shape
#: agreed with MLX's dense product of the dequantized weight (within ``TOLERANCE``) in this process.
_checked: dict[tuple[int, int, int, mx.Dtype, Plan], bool] = {}


def _check(w: Native, p: Plan, rows: int) -> bool | None:
    """Whether the launch ``p`` on ``w`` agrees with MLX's dense product of the dequantized weight on
    ``rows`` rows of seeded random activations (not the caller's: a calibration times its ways on zeros,
    where any kernel agrees), within ``TOLERANCE``; ``None`` where the values cannot be read here."""
    dtype = w.scales.dtype
    probe = (mx.random.normal((rows, w.k), key=mx.random.key(rows + w.k)) * 0.5).astype(dtype)
    got = native_matmul(probe, w, p) if launch_seam is None else launch_seam(probe, w, p)
    want = probe @ mx.dequantize(w.w, w.scales, w.biases, group_size=w.group_size, bits=4).T
    err = mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)))
    try:
        agreed = bool((err <= TOLERANCE * mx.max(mx.abs(want.astype(mx.float32)))).item())
    except Exception:
        return None
    if not agreed:
        log.warning(
            "w4a16 kernel: %s off from MLX's dense product by %s at N=%d K=%d; MLX's is used there", p, err, w.n, w.k
        )
    return agreed


def project(m: nn.Module, x: mx.array, tile: int = 0) -> mx.array | None:
    """``m(x)`` for flattened rows ``x`` [rows, K] through the kernel with ``TILES[tile]``, or ``None``
    where it does not take ``m`` (``takes``) or the first call of this launch plan on ``m``'s shape was
    off from MLX's (fail closed); activations are cast to the scales' dtype and back."""
    ok = _takes.get(id(m))
    if ok is None:
        ok = _takes[id(m)] = takes(m)
        weakref.finalize(m, _takes.pop, id(m), None)
    if not ok or x.ndim != 2:
        return None
    assert isinstance(m, nn.QuantizedLinear)
    w = _weight(m)
    p = tile_plan(x.shape[0], w.n, w.k, tile)
    key = (w.n, w.k, w.group_size, w.scales.dtype, p)
    agreed = _checked.get(key)
    if agreed is False:
        return None
    if agreed is None:
        agreed = _check(w, p, x.shape[0])
        if agreed is None:  # evaluated where a value cannot be read (a compiled graph): MLX's this time
            return None
        _checked[key] = agreed
        if not agreed:
            return None
    xs = x if x.dtype == w.scales.dtype else x.astype(w.scales.dtype)
    y = native_matmul(xs, w, p) if launch_seam is None else launch_seam(xs, w, p)
    if "bias" in m:
        y = y + m.bias
    return y if y.dtype == x.dtype else y.astype(x.dtype)
