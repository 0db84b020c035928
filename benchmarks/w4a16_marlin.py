"""A Marlin-style w4a16 GEMM for MLX's 4-bit affine quantized weights, for 1-256 activation rows.

``y = x @ dequantize(w).T`` with ``x`` [M, K] bf16 and MLX's 4-bit weights (``mx.quantize``, group 32,
64 or 128: packed uint32 [N, K/8], scales and biases [N, K/gs]). Two parts:

* ``repack`` (once, at load; MLX ops, any backend): the nibbles are reordered so that one uint32 holds
  exactly one lane's ``mma.m16n8k16`` B fragments for a 16-output x 16-K block (both n8 halves), and the
  four k16 words a lane needs for 64 K values are adjacent (one 16-byte load a lane, 512 contiguous
  bytes a warp). Scales and biases are interleaved so that a lane's (scale, bias) of its two outputs for
  one group are one 8-byte load. The resident size equals MLX's (weights N*K/2 bytes, scales and biases
  N*K/gs*4 bytes). ``unrepack`` inverts it bit for bit.
* the kernel (``mx.fast.cuda_kernel``): a CTA of ``WARPS`` warps owns ``16 * MT`` rows and
  ``16 * NB * WARPS`` outputs over a K slice (``gridDim.z`` slices; a partial sum a slice, added by the
  caller, when there are several). Activations go to shared memory 256 K columns at a time and are read
  with ``ldmatrix``; the weight words and scale pairs stream from global memory straight to registers
  four k64 steps ahead; each word is dequantized in registers (``(q | 0x4300)`` as bf16 is ``v = 128 + q``,
  then two ``fma.rn.bf16x2``: ``v * s - 128 s`` is ``s * q`` rounded once, plus the bias rounded: the
  bits of MLX's dequantize) and fed to ``mma.sync.m16n8k16`` bf16 with fp32 accumulators.

* the native kernel (``native``, ``native_matmul``): the same dequantization and MMAs straight from MLX's
  arrays (no repack, no second copy): each k64 step's packed words and activations are staged in
  swizzled shared memory with 16-byte ``cp.async`` (a pipeline of 2-4 steps), lanes take their weight
  words with ``ldmatrix`` and order K within each MMA to suit the word (``NATIVE_SOURCE`` says how).

The CUDA text lives in ``w4a16_marlin_source.py`` (helpers, repacked kernel, the shared store) and
``w4a16_marlin_native_source.py``. ``emulate`` (``emulate_native``, in ``w4a16_marlin_emulate.py``)
replays the kernel's per-lane index math in numpy (which word each lane loads, which nibbles
land in which fragment register, ``ldmatrix``'s row addresses, the C fragment's store positions), so the
layout is checked against ``mx.dequantize`` without a GPU (tests/unit/test_w4a16_marlin.py).
``w4a16_marlin_probe.py`` checks the kernel against a float32 reference and times it on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
from w4a16_marlin_emulate import emulate as emulate
from w4a16_marlin_emulate import emulate_native as emulate_native
from w4a16_marlin_native_source import NATIVE_HEADER, NATIVE_INPUT_NAMES, NATIVE_SOURCE
from w4a16_marlin_source import CH, HEADER, INPUT_NAMES, OUTPUT_NAMES, SOURCE

#: Streaming multiprocessors of the target GPU (H100 SXM / H200: 132).
SMS = 132
#: Group sizes the kernel takes (a k16 MMA step never straddles a group; K % 64 == 0 is required).
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class Plan:
    """One launch: ``mt`` 16-row tiles and ``nb`` 16-output blocks a warp, ``warps`` a CTA, ``splits`` K
    slices, their partials added by the kernel's last CTA a tile (``reduce``) or by an MLX sum after it."""

    mt: int
    nb: int
    warps: int
    splits: int
    reduce: bool = True
    xbuf: int = 2
    stages: int = 4

    def tiles(self, m: int, n: int) -> int:
        """CTAs a K slice (the counters the in-kernel reduction uses)."""
        gx, gy, _ = self.grid(m, n)
        return gx // (32 * self.warps) * gy

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        """The launch grid in threads (``mx.fast.cuda_kernel`` counts threads along x)."""
        row_tiles = -(-m // (16 * self.mt))
        n_ctas = -(-(n // 16) // (self.nb * self.warps))
        return row_tiles * 32 * self.warps, n_ctas, self.splits

    def shared_bytes(self) -> int:
        """Dynamic shared memory: ``xbuf`` chunks of activations (``16 * mt`` rows of 256 + 8 bf16)."""
        return self.xbuf * self.mt * 16 * (CH * 64 + 8) * 2

    def native_shared_bytes(self) -> int:
        """The native kernel's dynamic shared memory: ``stages`` k64 steps of activations (``16 * mt``
        rows of 64 bf16) and of MLX's packed weights (the CTA's outputs, 8 words each)."""
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
    xbuf: int | None = None,
    stages: int | None = None,
) -> Plan:
    """The tile for ``m`` rows (any field may be forced): 16/32/64-row tiles, two 16-output blocks a warp,
    four warps, and as many K slices as it takes to give every SM about ``ctas_per_sm`` CTAs (4 for
    16-row tiles, 2 for larger: bandwidth wants several CTAs an SM, the larger tiles fewer), at least two
    k64 steps a slice. ``stages`` (the native kernel's cp.async pipeline depth, 2-4) is the deepest that
    fits the default 48 KB of shared memory."""
    if mt is None:
        mt = 1 if m <= 16 else 2 if m <= 32 else 4
    nb = 2 if nb is None else nb
    warps = 4 if warps is None else warps
    if splits is None:
        if ctas_per_sm is None:
            ctas_per_sm = 4.0 if mt == 1 else 2.0
        row_tiles = -(-m // (16 * mt))
        ctas = row_tiles * -(-(n // 16) // (nb * warps))
        target = ctas_per_sm * SMS
        splits = 1 if ctas >= target / 2 else math.ceil(target / ctas)
        splits = max(1, min(splits, k // 64 // 2, 64))
    if xbuf is None:  # two activation buffers where they fit the default 48 KB of shared memory
        xbuf = 2 if Plan(mt, nb, warps, 1, xbuf=2).shared_bytes() <= 48000 else 1
    if stages is None:
        stages = next((st for st in (4, 3) if Plan(mt, nb, warps, 1, stages=st).native_shared_bytes() <= 48000), 2)
    return Plan(mt, nb, warps, max(1, min(splits, k // 64)), reduce, xbuf, max(2, stages))


def check_shapes(n: int, k: int, group_size: int) -> None:
    """Raise ``ValueError`` for a shape the kernel does not take."""
    if group_size not in GROUP_SIZES or k % 64 or k % group_size or n % 16:
        raise ValueError(
            f"w4a16_marlin: needs N % 16 == 0, K % 64 == 0, group in {GROUP_SIZES}; got N={n} K={k} gs={group_size}"
        )


# ---------------------------------------------------------------------------------------------------
# repack

#: Nibble position p of a repacked word -> (output offset, K offset) inside the 16 x 16 block, relative
#: to the lane's (g, 2t): p = klo * 4 + nh * 2 + kh, output g + 8 * nh, K 2t + klo + 8 * kh. Nibbles j
#: and j + 4 become one bf16x2 register (low, high): j = 0, 1 are B fragment b0, b1 of the first n8 half,
#: j = 2, 3 those of the second.
NIBBLE_OFFSETS = tuple(((p >> 1) & 1) * 8 for p in range(8)), tuple((p >> 2) + (p & 1) * 8 for p in range(8))


def _nibbles(w: mx.array) -> mx.array:
    """MLX's packed uint32 [N, K/8] -> uint32 nibbles [N, K] (low nibble first)."""
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    return ((w[:, :, None] >> shifts) & 15).reshape(w.shape[0], -1)


def repack(w: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64) -> tuple[mx.array, mx.array]:
    """MLX's 4-bit (w [N, K/8] uint32, scales/biases [N, K/gs]) -> (wq [N/16, 2K] uint32, sb [N/16, K/gs*32]).

    wq word ((nb * K/64 + kb) * 32 + lane) * 4 + kk holds the nibbles of outputs 16 nb + g (+8) and K
    16 (4 kb + kk) + 2t (+1, +8, +9) at positions ``NIBBLE_OFFSETS`` (g = lane / 4, t = lane % 4).
    sb entry ((nb * K/gs + grp) * 8 + g) * 4 + (0, 1, 2, 3) is (scale, bias) of output 16 nb + g, then
    of 16 nb + g + 8, for group grp."""
    n, k = w.shape[0], w.shape[1] * 8
    check_shapes(n, k, group_size)
    q = _nibbles(w)
    # n = 16 nb + 8 nh + g; k = 64 kb + 16 kk + 8 kh + 2 t + klo
    q = q.reshape(n // 16, 2, 8, k // 64, 4, 2, 4, 2)  # nb nh g kb kk kh t klo
    q = q.transpose(0, 3, 2, 6, 4, 7, 1, 5)  # nb kb g t kk | klo nh kh  (p = klo*4 + nh*2 + kh)
    q = q.reshape(n // 16, k // 64, 32, 4, 8)
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    wq = mx.sum(q << shifts, axis=-1).astype(mx.uint32).reshape(n // 16, 2 * k)
    sb = _pack_sb(scales, biases)
    return wq, sb


def _pack_sb(scales: mx.array, biases: mx.array) -> mx.array:
    n, groups = scales.shape
    sb = mx.stack([scales, biases], axis=-1).reshape(n // 16, 2, 8, groups, 2)  # nb nh g grp (s, b)
    return sb.transpose(0, 3, 2, 1, 4).reshape(n // 16, groups * 32)


def unrepack(wq: mx.array, sb: mx.array, group_size: int = 64) -> tuple[mx.array, mx.array, mx.array]:
    """The inverse of ``repack``: MLX's (w, scales, biases), bit for bit."""
    nblk, k = wq.shape[0], wq.shape[1] // 2
    n = nblk * 16
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    q = ((wq.reshape(nblk, k // 64, 32, 4)[..., None] >> shifts) & 15).reshape(nblk, k // 64, 8, 4, 4, 2, 2, 2)
    # nb kb g t kk klo nh kh -> nb nh g kb kk kh t klo
    q = q.transpose(0, 6, 2, 1, 4, 7, 3, 5).reshape(n, k // 8, 8)
    w = mx.sum(q << shifts, axis=-1).astype(mx.uint32)
    groups = k // group_size
    s = sb.reshape(nblk, groups, 8, 2, 2).transpose(0, 3, 2, 1, 4).reshape(n, groups, 2)
    return w, s[..., 0], s[..., 1]


# ---------------------------------------------------------------------------------------------------
# weights


@dataclass(frozen=True)
class Packed:
    """A weight as the kernel reads it: ``repack``'s arrays, the group size, and one int32 counter an
    output column (zero between launches; the in-kernel reduction's per-tile counters, so one weight's
    launches must not run concurrently with each other)."""

    wq: mx.array
    sb: mx.array
    locks: mx.array
    group_size: int

    @property
    def n(self) -> int:
        return self.wq.shape[0] * 16

    @property
    def k(self) -> int:
        return self.wq.shape[1] // 2

    @property
    def nbytes(self) -> int:
        return self.wq.nbytes + self.sb.nbytes + self.locks.nbytes


def pack(w: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64) -> Packed:
    """``repack`` plus the reduction counters: what ``matmul`` takes."""
    wq, sb = repack(w, scales, biases, group_size)
    return Packed(wq, sb, mx.zeros((w.shape[0],), dtype=mx.int32), group_size)


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
        return self.w.nbytes + self.scales.nbytes + self.biases.nbytes + self.locks.nbytes


def native(w: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64) -> Native:
    """MLX's 4-bit arrays and the reduction counters: what ``native_matmul`` takes (no copy)."""
    check_shapes(w.shape[0], w.shape[1] * 8, group_size)
    if scales.dtype != mx.bfloat16 or biases.dtype != mx.bfloat16:
        raise ValueError("w4a16_marlin: native needs bf16 scales and biases")
    return Native(w, scales, biases, mx.zeros((w.shape[0],), dtype=mx.int32), group_size)


# ---------------------------------------------------------------------------------------------------
# kernels

Layout = Literal["repacked", "native"]


@dataclass(frozen=True)
class Kernel:
    """What one layout's kernel is built from: its name's tag, the template argument that sets its
    pipeline depth (``XB`` activation buffers, ``STAGES`` cp.async steps), its inputs and its text."""

    tag: str
    depth: str
    input_names: list[str]
    source: str
    header: str

    def depth_of(self, p: Plan) -> int:
        """The plan's value of the depth argument."""
        return p.xbuf if self.depth == "XB" else p.stages

    def shared_bytes(self, p: Plan) -> int:
        """The dynamic shared memory a launch of this plan takes."""
        return p.shared_bytes() if self.depth == "XB" else p.native_shared_bytes()


LAYOUTS: dict[str, Kernel] = {
    "repacked": Kernel("w4m", "XB", INPUT_NAMES, SOURCE, HEADER),
    "native": Kernel("w4n", "STAGES", NATIVE_INPUT_NAMES, NATIVE_SOURCE, NATIVE_HEADER),
}

_kernels: dict[str, Any] = {}


def kernel_name(p: Plan, gs: int, split: bool, reduce: bool, layout: Layout = "repacked") -> str:
    """One name a variant (MLX caches compiled kernels by name)."""
    kern = LAYOUTS[layout]
    return f"mlx_batchd_{kern.tag}_{p.mt}_{p.nb}_{p.warps}_{kern.depth_of(p)}_{gs}_{int(split)}{int(reduce)}"


def template(
    p: Plan, gs: int, split: bool, reduce: bool, layout: Layout = "repacked", dtype: Any = mx.bfloat16
) -> list[tuple[str, Any]]:
    """The kernel's template arguments for a plan."""
    kern = LAYOUTS[layout]
    return [
        ("T", dtype),
        ("MT", p.mt),
        ("NB", p.nb),
        ("WARPS", p.warps),
        (kern.depth, kern.depth_of(p)),
        ("GS", gs),
        ("SPLIT", split),
        ("REDUCE", reduce),
    ]


def _kernel(p: Plan, gs: int, split: bool, reduce: bool, layout: Layout) -> Any:
    name = kernel_name(p, gs, split, reduce, layout)
    kernel = _kernels.get(name)
    if kernel is None:
        kern = LAYOUTS[layout]
        kernel = _kernels[name] = mx.fast.cuda_kernel(
            name=name,
            input_names=kern.input_names,
            output_names=OUTPUT_NAMES,
            source=kern.source,
            header=kern.header,
            shared_memory=kern.shared_bytes(p),
        )
    return kernel


def _launch(layout: Layout, x: mx.array, w: Packed | Native, arrays: list[mx.array], p: Plan | None) -> mx.array:
    """Check the shapes, plan, launch ``layout``'s kernel on ``[x, *arrays, locks]``; bf16 [M, N]."""
    if x.dtype != mx.bfloat16 or x.ndim != 2:
        raise ValueError("w4a16_marlin: 2-D bf16 activations only")
    m, k = x.shape
    n = w.n
    check_shapes(n, k, w.group_size)
    if w.k != k:
        raise ValueError(f"w4a16_marlin: x has K={k}, the weight {w.k}")
    if m == 0:
        return mx.zeros((0, n), dtype=mx.bfloat16)
    p = p or plan(m, n, k)
    if layout == "native" and not 2 <= p.stages <= 4:
        raise ValueError(f"w4a16_marlin: native takes 2-4 stages, got {p.stages}")
    split = p.splits > 1
    reduce = split and p.reduce and p.tiles(m, n) <= w.locks.size
    out, ws = _kernel(p, w.group_size, split, reduce, layout)(
        inputs=[x, *arrays, w.locks],
        template=template(p, w.group_size, split, reduce, layout),
        grid=p.grid(m, n),
        threadgroup=(32 * p.warps, 1, 1),
        output_shapes=[(m, n), (p.splits, m, n) if split else (1,)],
        output_dtypes=[mx.bfloat16, mx.float32],
    )
    if split and not reduce:
        return ws.sum(axis=0).astype(mx.bfloat16)
    return out


def matmul(x: mx.array, w: Packed, p: Plan | None = None) -> mx.array:
    """``x @ dequantize(w).T`` for bf16 ``x`` [M, K] and a packed weight (``pack``); bf16 [M, N]."""
    return _launch("repacked", x, w, [w.wq, w.sb], p)


def native_matmul(x: mx.array, w: Native, p: Plan | None = None) -> mx.array:
    """``x @ dequantize(w).T`` straight from MLX's packed arrays (``native``); bf16 [M, N]."""
    return _launch("native", x, w, [w.w, w.scales, w.biases], p)
