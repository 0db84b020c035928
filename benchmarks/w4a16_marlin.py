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

* the native kernel (``native``, ``native_matmul``: the engine's, ``workers.kernels.w4a16``): the same
  dequantization and MMAs straight from MLX's arrays (no repack, no second copy): each k64 step's packed
  words and activations are staged in swizzled shared memory with 16-byte ``cp.async`` (a pipeline of
  2-4 steps), lanes take their weight words with ``ldmatrix`` and order K within each MMA to suit the
  word (``workers.kernels.w4a16_source`` says how).

The repacked kernel's CUDA text lives in ``w4a16_marlin_source.py``. ``emulate (``emulate_native``, in ``w4a16_marlin_emulate.py``)
replays the kernel's per-lane index math in numpy (which word each lane loads, which nibbles
land in which fragment register, ``ldmatrix``'s row addresses, the C fragment's store positions), so the
layout is checked against ``mx.dequantize`` without a GPU (tests/unit/test_w4a16_marlin.py).
``w4a16_marlin_probe.py`` checks the kernel against a float32 reference and times it on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
from w4a16_marlin_emulate import cuda_dequantize as cuda_dequantize
from w4a16_marlin_emulate import emulate as emulate
from w4a16_marlin_emulate import emulate_native as emulate_native
from w4a16_marlin_source import CH, HEADER, INPUT_NAMES, SOURCE

from workers.kernels import w4a16
from workers.kernels.w4a16 import GROUP_SIZES as GROUP_SIZES
from workers.kernels.w4a16 import Kernel as Kernel
from workers.kernels.w4a16 import Native as Native
from workers.kernels.w4a16 import available as available
from workers.kernels.w4a16 import check_shapes as check_shapes
from workers.kernels.w4a16 import native as native
from workers.kernels.w4a16_source import OUTPUT_NAMES as OUTPUT_NAMES

#: Streaming multiprocessors of the target GPU (H100 SXM / H200: 132).
SMS = w4a16.DEFAULT_SMS


@dataclass(frozen=True)
class Plan(w4a16.Plan):
    """The engine's launch plan (``workers.kernels.w4a16.Plan``) plus the repacked layout's ``xbuf``
    activation buffers (2 overlaps the next chunk's copy with this one's MMAs)."""

    xbuf: int = 2

    def shared_bytes(self) -> int:
        """The repacked kernel's dynamic shared memory: ``xbuf`` chunks of activations (``16 * mt`` rows of
        256 + 8 bf16)."""
        return self.xbuf * self.mt * 16 * (CH * 64 + 8) * 2


def plan(m: int, n: int, k: int, xbuf: int | None = None, **over: Any) -> Plan:
    """``workers.kernels.w4a16.plan`` (any field may be forced) with the repacked layout's ``xbuf``: two
    activation buffers where they fit the default 48 KB of shared memory."""
    p = w4a16.plan(m, n, k, **over)
    if xbuf is None:
        xbuf = 2 if Plan(p.mt, p.nb, p.warps, 1, xbuf=2).shared_bytes() <= w4a16.SHARED_LIMIT else 1
    return Plan(p.mt, p.nb, p.warps, p.splits, p.reduce, p.stages, p.regs, xbuf=xbuf)


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


# ---------------------------------------------------------------------------------------------------
# kernels

Layout = Literal["repacked", "native"]

REPACKED = Kernel("w4m", "XB", lambda p: p.xbuf, lambda p: p.shared_bytes(), INPUT_NAMES, SOURCE, HEADER)
LAYOUTS: dict[str, Kernel] = {"repacked": REPACKED, "native": w4a16.NATIVE}


def kernel_name(p: Plan, gs: int, split: bool, reduce: bool, layout: Layout = "repacked") -> str:
    """One name a variant (MLX caches compiled kernels by name)."""
    return w4a16.kernel_name(LAYOUTS[layout], p, gs, split, reduce)


def template(p: Plan, gs: int, split: bool, reduce: bool, layout: Layout = "repacked") -> list[tuple[str, Any]]:
    """The kernel's template arguments for a plan."""
    return w4a16.template(LAYOUTS[layout], p, gs, split, reduce)


def matmul(x: mx.array, w: Packed, p: Plan | None = None) -> mx.array:
    """``x @ dequantize(w).T`` for bf16 ``x`` [M, K] and a packed weight (``pack``); bf16 [M, N]."""
    p = p or plan(x.shape[0], w.n, w.k)
    return w4a16.launch(REPACKED, x, w.n, w.k, w.group_size, [w.wq, w.sb], w.locks, p)


def native_matmul(x: mx.array, w: Native, p: Plan | None = None) -> mx.array:
    """``x @ dequantize(w).T`` straight from MLX's packed arrays (``workers.kernels.w4a16``); bf16 [M, N]."""
    return w4a16.native_matmul(x, w, p)
