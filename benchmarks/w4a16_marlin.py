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

``emulate`` (``emulate_native``) replays the kernel's per-lane index math in numpy (which word each lane loads, which nibbles
land in which fragment register, ``ldmatrix``'s row addresses, the C fragment's store positions), so the
layout is checked against ``mx.dequantize`` without a GPU (tests/unit/test_w4a16_marlin.py).
``w4a16_marlin_probe.py`` checks the kernel against a float32 reference and times it on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

#: k64 steps a chunk of activations in shared memory, and steps of weight loads in flight (equal: the
#: register ring's slot is the step's index in its chunk).
CH = 4
#: Streaming multiprocessors of the target GPU (H100 SXM / H200: 132).
SMS = 132
#: Group sizes the kernel takes (a k16 MMA step never straddles a group; K % 64 == 0 is required).
GROUP_SIZES = (32, 64, 128)

HEADER = r"""
#undef FP_NAN
#undef FP_INFINITE
#undef FP_ZERO
#undef FP_SUBNORMAL
#undef FP_NORMAL

namespace w4m {

__device__ __forceinline__ void mma_bf16_16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t bfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Two weights of one word: nibbles j (low half) and j + 4 (high half), shifted down by 4 * j before
// the call. (q | 0x4300) as bf16 is v = 128 + q. fma(v, s, -128 s) is s * q rounded once (-128 s is
// exact), then + bias rounded: bit for bit MLX's dequantize (scale * q + bias in bf16, two roundings).
__device__ __forceinline__ uint32_t dq2(uint32_t w, uint32_t s2, uint32_t ns2, uint32_t b2) {
  const uint32_t v = (w & 0x000f000fu) | 0x43004300u;
  const uint32_t sq = bfma2(v, s2, ns2);
  return bfma2(sq, 0x3f803f80u, b2);
}

// (-128 s, -128 s): exact.
__device__ __forceinline__ uint32_t neg128(uint32_t s2) { return bfma2(s2, 0xc300c300u, 0x80008000u); }

// 16 bytes global -> shared, bypassing L1; zero-filled when !ok (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

__device__ __forceinline__ uint32_t u4get(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

}  // namespace w4m
"""

#: Template: T (bf16), MT (16-row tiles a CTA), NB (16-output blocks a warp), WARPS, XB (activation
#: buffers: 2 overlaps the next chunk's copy with this one's MMAs), GS, SPLIT (several K
#: slices: fp32 partials to ``ws`` [S, M, N]), REDUCE (the last CTA of a tile adds them into ``out``; else
#: the caller does). Inputs x, wq, sb, locks (int32, zero between launches); outputs out bf16 [M, N], ws.
#: Grid: (row tiles * 32 * WARPS, CTAs along N, K slices) threads, threadgroup (32 * WARPS, 1, 1).
SOURCE = r"""
  constexpr int CHK = 4;                 // k64 steps a chunk == register ring depth (CH in Python)
  constexpr int ROWS = MT * 16;
  constexpr int LDS = CHK * 64 + 8;      // shared row stride (elements): +16 bytes against bank conflicts
  constexpr int GPS = GS >= 64 ? 1 : 64 / GS;   // groups a k64 step
  extern __shared__ __align__(16) unsigned char w4m_smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(w4m_smem);

  const int M = x_shape[0];
  const int K = x_shape[1];
  const int NBLK = wq_shape[0];          // 16-output blocks
  const int N = NBLK * 16;
  const int KB = K / 64;                 // k64 steps
  const int G = K / GS;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int m0 = blockIdx.x * ROWS;
  const int nb0 = (blockIdx.y * WARPS + warp) * NB;
  const int S = gridDim.z;
  const int z = blockIdx.z;
  const int s_lo = (int)(((long long)z * KB) / S);
  const int s_hi = (int)(((long long)(z + 1) * KB) / S);

  const uint4* wq4 = reinterpret_cast<const uint4*>(wq);
  const uint2* sb2 = reinterpret_cast<const uint2*>(sb);
  const uint32_t xs_base = (uint32_t)__cvta_generic_to_shared(xs);

  float acc[MT][NB][2][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][h][e] = 0.f;

  uint4 bw[CHK][NB];
  uint2 bs[CHK][NB][GPS];

  // Ring slot p holds step s_lo + p (mod CHK). Blocks past N are clamped (loaded, never stored).
#define W4M_LOAD(SLOT, STEP)                                                          \
  _Pragma("unroll") for (int j = 0; j < NB; ++j) {                                    \
    const int nb = min(nb0 + j, NBLK - 1);                                            \
    bw[SLOT][j] = w4m::ldg_stream(wq4 + ((size_t)nb * KB + (STEP)) * 32 + lane);      \
    _Pragma("unroll") for (int gi = 0; gi < GPS; ++gi) {                              \
      const int grp = ((STEP) * 64 + gi * GS) / GS;                                   \
      bs[SLOT][j][gi] = __ldg(sb2 + ((size_t)nb * G + grp) * 8 + g);                  \
    }                                                                                 \
  }

#pragma unroll
  for (int p = 0; p < CHK; ++p)
    if (s_lo + p < s_hi) { W4M_LOAD(p, s_lo + p) }

  // Activations: chunk c0's rows m0.. and K columns c0 * 64.. (zero past M and past the slice) into
  // buffer buf with cp.async; with XB == 2 the next chunk's copy runs during this chunk's MMAs.
  auto load_x = [&](int c, int buf) {
    const int cols8 = (min(c + CHK, s_hi) - c) * 8;  // 16-byte columns of this chunk
    for (int i = threadIdx.x; i < ROWS * CHK * 8; i += WARPS * 32) {
      const int r = i / (CHK * 8);
      const int cc = i - r * (CHK * 8);
      const bool ok = m0 + r < M && cc < cols8;
      const __nv_bfloat16* src = ok ? x + (size_t)(m0 + r) * K + (size_t)c * 64 + cc * 8 : x;
      w4m::cp_async16(xs_base + (uint32_t)(((buf * ROWS + r) * LDS + cc * 8) * 2), src, ok);
    }
    w4m::cp_async_commit();
  };
  load_x(s_lo, 0);
  int buf = 0;
  for (int c0 = s_lo; c0 < s_hi; c0 += CHK) {
    if constexpr (XB == 2) {
      if (c0 + CHK < s_hi) {
        load_x(c0 + CHK, buf ^ 1);
        w4m::cp_async_wait<1>();
      } else {
        w4m::cp_async_wait<0>();
      }
    } else {
      if (c0 != s_lo) load_x(c0, 0);
      w4m::cp_async_wait<0>();
    }
    __syncthreads();
    const uint32_t xb = xs_base + (uint32_t)(buf * ROWS * LDS * 2);
#pragma unroll
    for (int p = 0; p < CHK; ++p) {
      const int step = c0 + p;
      if (step < s_hi) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          uint32_t a[MT][4];
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            const int row = i * 16 + (lane & 15);
            const int col = p * 64 + kk * 16 + (lane >> 4) * 8;
            w4m::ldsm_x4(a[i], xb + (uint32_t)((row * LDS + col) * 2));
          }
#pragma unroll
          for (int j = 0; j < NB; ++j) {
            const uint32_t w = w4m::u4get(bw[p][j], kk);
            const uint2 sc = bs[p][j][GPS == 1 ? 0 : (kk * 16) / GS];
            const uint32_t s_lo2 = __byte_perm(sc.x, 0, 0x1010);   // (scale, scale) of output g
            const uint32_t b_lo2 = __byte_perm(sc.x, 0, 0x3232);   // (bias, bias) of output g
            const uint32_t s_hi2 = __byte_perm(sc.y, 0, 0x1010);   // output g + 8
            const uint32_t b_hi2 = __byte_perm(sc.y, 0, 0x3232);
            const uint32_t n_lo2 = w4m::neg128(s_lo2);
            const uint32_t n_hi2 = w4m::neg128(s_hi2);
            const uint32_t b00 = w4m::dq2(w, s_lo2, n_lo2, b_lo2);        // n8 half 0, k 2t, 2t+1
            const uint32_t b01 = w4m::dq2(w >> 4, s_lo2, n_lo2, b_lo2);   // n8 half 0, k 2t+8, 2t+9
            const uint32_t b10 = w4m::dq2(w >> 8, s_hi2, n_hi2, b_hi2);   // n8 half 1
            const uint32_t b11 = w4m::dq2(w >> 12, s_hi2, n_hi2, b_hi2);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
              w4m::mma_bf16_16816(acc[i][j][0], a[i], b00, b01);
              w4m::mma_bf16_16816(acc[i][j][1], a[i], b10, b11);
            }
          }
        }
        if (step + CHK < s_hi) { W4M_LOAD(p, step + CHK) }
      }
    }
    __syncthreads();  // every warp is done with this buffer before a copy refills it
    if constexpr (XB == 2) buf ^= 1;
  }
  w4m::cp_async_wait<0>();
#undef W4M_LOAD

#pragma unroll
  for (int i = 0; i < MT; ++i) {
    const int r0 = m0 + i * 16 + g;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      if (nb0 + j >= NBLK) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = (nb0 + j) * 16 + h * 8 + 2 * t;
        const float* c = acc[i][j][h];
        if constexpr (SPLIT) {
          float* o = ws + (size_t)z * M * N;
          if (r0 < M) *reinterpret_cast<float2*>(o + (size_t)r0 * N + n) = make_float2(c[0], c[1]);
          if (r0 + 8 < M) *reinterpret_cast<float2*>(o + (size_t)(r0 + 8) * N + n) = make_float2(c[2], c[3]);
        } else {
          if (r0 < M)
            *reinterpret_cast<__nv_bfloat162*>(out + (size_t)r0 * N + n) = __floats2bfloat162_rn(c[0], c[1]);
          if (r0 + 8 < M)
            *reinterpret_cast<__nv_bfloat162*>(out + (size_t)(r0 + 8) * N + n) = __floats2bfloat162_rn(c[2], c[3]);
        }
      }
    }
  }

  // Several K slices, REDUCE: the last CTA of a tile to finish (a counter a tile in ``locks``, which it
  // resets to zero) adds the slices' partials in slice order and writes bf16: deterministic.
  if constexpr (SPLIT && REDUCE) {
    __shared__ int w4m_last;
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    int* lk = const_cast<int*>(reinterpret_cast<const int*>(locks));
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) w4m_last = atomicAdd(lk + tile, 1) == S - 1;
    __syncthreads();
    if (!w4m_last) return;
    __threadfence();
    constexpr int CTA_PAIRS = WARPS * NB * 8;   // column pairs of the CTA's outputs
    const int n_lo = blockIdx.y * WARPS * NB * 16;
    for (int i = threadIdx.x; i < ROWS * CTA_PAIRS; i += WARPS * 32) {
      const int r = m0 + i / CTA_PAIRS;
      const int n = n_lo + 2 * (i % CTA_PAIRS);
      if (r < M && n < N) {
        float2 v = make_float2(0.f, 0.f);
        for (int zz = 0; zz < S; ++zz) {
          const float2 p = __ldcg(reinterpret_cast<const float2*>(ws + ((size_t)zz * M + r) * N + n));
          v.x += p.x;
          v.y += p.y;
        }
        *reinterpret_cast<__nv_bfloat162*>(out + (size_t)r * N + n) = __floats2bfloat162_rn(v.x, v.y);
      }
    }
    if (threadIdx.x == 0) lk[tile] = 0;
  }
"""

INPUT_NAMES = ["x", "wq", "sb", "locks"]
OUTPUT_NAMES = ["out", "ws"]


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
# kernel

_kernels: dict[tuple[int, ...], Any] = {}


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


def _kernel(p: Plan, gs: int, split: bool, reduce: bool) -> Any:
    key = (p.mt, p.nb, p.warps, p.xbuf, gs, split, reduce)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = mx.fast.cuda_kernel(
            name=kernel_name(p, gs, split, reduce),
            input_names=INPUT_NAMES,
            output_names=OUTPUT_NAMES,
            source=SOURCE,
            header=HEADER,
            shared_memory=p.shared_bytes(),
        )
    return kernel


def kernel_name(p: Plan, gs: int, split: bool, reduce: bool) -> str:
    """One name a variant (MLX caches compiled kernels by name)."""
    return f"mlx_batchd_w4m_{p.mt}_{p.nb}_{p.warps}_{p.xbuf}_{gs}_{int(split)}{int(reduce)}"


def template(p: Plan, gs: int, split: bool, reduce: bool, dtype: Any = mx.bfloat16) -> list[tuple[str, Any]]:
    """The kernel's template arguments for a plan."""
    return [
        ("T", dtype),
        ("MT", p.mt),
        ("NB", p.nb),
        ("WARPS", p.warps),
        ("XB", p.xbuf),
        ("GS", gs),
        ("SPLIT", split),
        ("REDUCE", reduce),
    ]


def matmul(x: mx.array, w: Packed, p: Plan | None = None) -> mx.array:
    """``x @ dequantize(w).T`` for bf16 ``x`` [M, K] and a packed weight (``pack``); bf16 [M, N]."""
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
    split = p.splits > 1
    reduce = split and p.reduce and p.tiles(m, n) <= w.locks.size
    out, ws = _kernel(p, w.group_size, split, reduce)(
        inputs=[x, w.wq, w.sb, w.locks],
        template=template(p, w.group_size, split, reduce),
        grid=p.grid(m, n),
        threadgroup=(32 * p.warps, 1, 1),
        output_shapes=[(m, n), (p.splits, m, n) if split else (1,)],
        output_dtypes=[mx.bfloat16, mx.float32],
    )
    if split and not reduce:
        return ws.sum(axis=0).astype(mx.bfloat16)
    return out


# ---------------------------------------------------------------------------------------------------
# native: MLX's packed arrays as they are (no repack)

NATIVE_HEADER = (
    HEADER
    + r"""
namespace w4n {

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

}  // namespace w4n
"""
)

#: The repacked kernel's store and split-K reduction, shared by the native kernel (same names: acc, m0,
#: nb0, NBLK, N, M, g, t, z, S, out, ws, locks).
_EPILOGUE = SOURCE[SOURCE.index("#undef W4M_LOAD\n") + len("#undef W4M_LOAD\n") :]

#: Template: T, MT, NB, WARPS, STAGES (k64 steps in flight, 2-4), GS, SPLIT, REDUCE. Inputs x, w (MLX's
#: packed uint32 [N, K/8]), scales, biases (bf16 [N, K/gs]), locks; outputs out, ws; grid as SOURCE's.
#:
#: Each k64 step, the CTA copies its activations (``16 * MT`` rows of 128 bytes) and its outputs' packed
#: words (``16 * NB * WARPS`` rows of 32 bytes, MLX's row-major layout) to shared memory with 16-byte
#: cp.async, STAGES - 1 steps ahead. Shared layouts (16-byte units, XOR-swizzled so that every 8-lane
#: phase touches 8 distinct units): activation row r's unit u sits at r * 8 + (u ^ 4 (r & 1)); weight row
#: r's unit u at r * 2 + (u ^ ((r >> 2) & 1)). ``ldmatrix.x4`` over the weights hands lane (g, t) word t
#: of row g of each 16-byte unit: the eight nibbles of K 8t..8t+7 of one k32 half. The MMAs take K in the
#: order that suits this word: MMA u (0, 1) of a k32 half has B fragments (nibbles 2u, 2u + 4) and
#: (2u + 1, 2u + 5), dequantized by ``w4m::dq2`` on ``w >> 8u`` and ``w >> (8u + 4)`` (MLX's bits, as
#: before); the lane's A fragments are the same K of its activation rows: one 16-byte shared load of
#: row g's K 8t..8t+7 and two ``prmt`` an MMA. Scales and biases (2-byte loads, read STAGES steps ahead
#: into registers) are MLX's arrays too.
NATIVE_SOURCE = (
    r"""
  constexpr int ST = STAGES;
  constexpr int ROWS = MT * 16;
  constexpr int NC = WARPS * NB * 16;    // outputs a CTA
  constexpr int XSTAGE = ROWS * 128;     // bytes a stage: ROWS rows of 64 bf16
  constexpr int WSTAGE = NC * 32;        // bytes a stage: NC rows of 8 packed words
  constexpr int GPS = GS >= 64 ? 1 : 64 / GS;   // groups a k64 step
  extern __shared__ __align__(16) unsigned char w4m_smem[];

  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[0];
  const int NBLK = N / 16;
  const int KW = K / 8;                  // packed words a row
  const int KB = K / 64;
  const int G = K / GS;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int m0 = blockIdx.x * ROWS;
  const int n_cta = blockIdx.y * NC;
  const int nb0 = (blockIdx.y * WARPS + warp) * NB;
  const int S = gridDim.z;
  const int z = blockIdx.z;
  const int s_lo = (int)(((long long)z * KB) / S);
  const int s_hi = (int)(((long long)(z + 1) * KB) / S);

  const uint32_t xs_base = (uint32_t)__cvta_generic_to_shared(w4m_smem);
  const uint32_t wsm_base = xs_base + ST * XSTAGE;
  const unsigned short* sc16 = reinterpret_cast<const unsigned short*>(scales);
  const unsigned short* bi16 = reinterpret_cast<const unsigned short*>(biases);

  float acc[MT][NB][2][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][h][e] = 0.f;

  // (scale of output g, of g + 8, bias of g, of g + 8) of each 16-output block and group of a step;
  // ring slot p holds step s_lo + p (mod ST). Blocks past N are clamped (loaded, never stored).
  uint32_t sc[ST][NB][GPS][4];
#define W4N_SCALES(SLOT, STEP)                                                        \
  _Pragma("unroll") for (int j = 0; j < NB; ++j) {                                    \
    const size_t n = (size_t)min(nb0 + j, NBLK - 1) * 16 + g;                         \
    _Pragma("unroll") for (int gi = 0; gi < GPS; ++gi) {                              \
      const size_t o = n * G + ((STEP) * 64 + gi * GS) / GS;                          \
      sc[SLOT][j][gi][0] = __ldg(sc16 + o);                                           \
      sc[SLOT][j][gi][1] = __ldg(sc16 + o + 8 * (size_t)G);                           \
      sc[SLOT][j][gi][2] = __ldg(bi16 + o);                                           \
      sc[SLOT][j][gi][3] = __ldg(bi16 + o + 8 * (size_t)G);                           \
    }                                                                                 \
  }

  // One k64 step's activations (zero rows past M) and packed words (rows past N clamped) into a slot.
  auto load_stage = [&](int step, int slot) {
    const uint32_t xd = xs_base + (uint32_t)(slot * XSTAGE);
    for (int i = threadIdx.x; i < ROWS * 8; i += WARPS * 32) {
      const int r = i >> 3;
      const int u = i & 7;
      const bool ok = m0 + r < M;
      const __nv_bfloat16* src = ok ? x + (size_t)(m0 + r) * K + (size_t)step * 64 + u * 8 : x;
      w4m::cp_async16(xd + (uint32_t)((r * 8 + (u ^ ((r & 1) << 2))) * 16), src, ok);
    }
    const uint32_t wd = wsm_base + (uint32_t)(slot * WSTAGE);
    for (int i = threadIdx.x; i < NC * 2; i += WARPS * 32) {
      const int r = i >> 1;
      const int u = i & 1;
      const int n = min(n_cta + r, N - 1);
      w4m::cp_async16(wd + (uint32_t)((r * 2 + (u ^ ((r >> 2) & 1))) * 16),
                      w + (size_t)n * KW + (size_t)step * 8 + u * 4, true);
    }
  };

#pragma unroll
  for (int p = 0; p < ST - 1; ++p) {
    if (s_lo + p < s_hi) load_stage(s_lo + p, p);
    w4m::cp_async_commit();
  }
#pragma unroll
  for (int p = 0; p < ST; ++p)
    if (s_lo + p < s_hi) { W4N_SCALES(p, s_lo + p) }

  for (int s0 = s_lo; s0 < s_hi; s0 += ST) {
#pragma unroll
    for (int p = 0; p < ST; ++p) {
      const int step = s0 + p;
      if (step < s_hi) {
        w4m::cp_async_wait<ST - 2>();    // this step's copy is done (one group a step, empty ones too)
        __syncthreads();                 // ... for every thread, and the slot of step - 1 is free
        if (step + ST - 1 < s_hi) load_stage(step + ST - 1, (p + ST - 1) % ST);
        w4m::cp_async_commit();
        const uint32_t xb = xs_base + (uint32_t)(p * XSTAGE);
        const uint32_t wb = wsm_base + (uint32_t)(p * WSTAGE);
        // matrix i = 2 * n8 half + k32 half; lanes 8i..8i+7 address its rows
        uint32_t bw[NB][4];
#pragma unroll
        for (int j = 0; j < NB; ++j) {
          const int mi = lane >> 3;
          const int r = (warp * NB + j) * 16 + 8 * (mi >> 1) + (lane & 7);
          w4m::ldsm_x4(bw[j], wb + (uint32_t)((r * 2 + ((mi & 1) ^ ((r >> 2) & 1))) * 16));
        }
#pragma unroll
        for (int c32 = 0; c32 < 2; ++c32) {
          uint32_t a[MT][2][4];
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            const int r = i * 16 + g;    // and r + 8: same swizzle (same parity)
            const int u = (c32 * 4 + t) ^ ((r & 1) << 2);
            const uint4 lo = w4n::lds128(xb + (uint32_t)((r * 8 + u) * 16));
            const uint4 hi = w4n::lds128(xb + (uint32_t)(((r + 8) * 8 + u) * 16));
            a[i][0][0] = __byte_perm(lo.x, lo.z, 0x5410);   // K 8t, 8t+4 of row g
            a[i][0][1] = __byte_perm(hi.x, hi.z, 0x5410);   // row g + 8
            a[i][0][2] = __byte_perm(lo.x, lo.z, 0x7632);   // K 8t+1, 8t+5
            a[i][0][3] = __byte_perm(hi.x, hi.z, 0x7632);
            a[i][1][0] = __byte_perm(lo.y, lo.w, 0x5410);   // K 8t+2, 8t+6
            a[i][1][1] = __byte_perm(hi.y, hi.w, 0x5410);
            a[i][1][2] = __byte_perm(lo.y, lo.w, 0x7632);   // K 8t+3, 8t+7
            a[i][1][3] = __byte_perm(hi.y, hi.w, 0x7632);
          }
#pragma unroll
          for (int j = 0; j < NB; ++j) {
            const uint32_t* q = sc[p][j][GPS == 1 ? 0 : c32];   // group 32: one group a k32 half
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint32_t s2 = __byte_perm(q[h], 0, 0x1010);
              const uint32_t b2 = __byte_perm(q[2 + h], 0, 0x1010);
              const uint32_t n2 = w4m::neg128(s2);
              const uint32_t wv = bw[j][h * 2 + c32];
#pragma unroll
              for (int u = 0; u < 2; ++u) {
                const uint32_t b0 = w4m::dq2(wv >> (8 * u), s2, n2, b2);       // nibbles 2u, 2u+4
                const uint32_t b1 = w4m::dq2(wv >> (8 * u + 4), s2, n2, b2);   // nibbles 2u+1, 2u+5
#pragma unroll
                for (int i = 0; i < MT; ++i) w4m::mma_bf16_16816(acc[i][j][h], a[i][u], b0, b1);
              }
            }
          }
        }
        if (step + ST < s_hi) { W4N_SCALES(p, step + ST) }
      }
    }
  }
  w4m::cp_async_wait<0>();
#undef W4N_SCALES
"""
    + _EPILOGUE
)

NATIVE_INPUT_NAMES = ["x", "w", "scales", "biases", "locks"]


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


def native_kernel_name(p: Plan, gs: int, split: bool, reduce: bool) -> str:
    """One name a native variant."""
    return f"mlx_batchd_w4n_{p.mt}_{p.nb}_{p.warps}_{p.stages}_{gs}_{int(split)}{int(reduce)}"


def native_template(p: Plan, gs: int, split: bool, reduce: bool, dtype: Any = mx.bfloat16) -> list[tuple[str, Any]]:
    """The native kernel's template arguments for a plan."""
    return [
        ("T", dtype),
        ("MT", p.mt),
        ("NB", p.nb),
        ("WARPS", p.warps),
        ("STAGES", p.stages),
        ("GS", gs),
        ("SPLIT", split),
        ("REDUCE", reduce),
    ]


def _native_kernel(p: Plan, gs: int, split: bool, reduce: bool) -> Any:
    key = (-1, p.mt, p.nb, p.warps, p.stages, gs, split, reduce)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = mx.fast.cuda_kernel(
            name=native_kernel_name(p, gs, split, reduce),
            input_names=NATIVE_INPUT_NAMES,
            output_names=OUTPUT_NAMES,
            source=NATIVE_SOURCE,
            header=NATIVE_HEADER,
            shared_memory=p.native_shared_bytes(),
        )
    return kernel


def native_matmul(x: mx.array, w: Native, p: Plan | None = None) -> mx.array:
    """``x @ dequantize(w).T`` straight from MLX's packed arrays (``native``); bf16 [M, N]."""
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
    if not 2 <= p.stages <= 4:
        raise ValueError(f"w4a16_marlin: native takes 2-4 stages, got {p.stages}")
    split = p.splits > 1
    reduce = split and p.reduce and p.tiles(m, n) <= w.locks.size
    out, ws = _native_kernel(p, w.group_size, split, reduce)(
        inputs=[x, w.w, w.scales, w.biases, w.locks],
        template=native_template(p, w.group_size, split, reduce),
        grid=p.grid(m, n),
        threadgroup=(32 * p.warps, 1, 1),
        output_shapes=[(m, n), (p.splits, m, n) if split else (1,)],
        output_dtypes=[mx.bfloat16, mx.float32],
    )
    if split and not reduce:
        return ws.sum(axis=0).astype(mx.bfloat16)
    return out


# ---------------------------------------------------------------------------------------------------
# CPU emulation of the kernel's index math


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _round_bf16(v: np.ndarray) -> np.ndarray:
    """Round float64/32 to the nearest bf16 (ties to even), returned as float32."""
    u = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return _bf16_bits_to_f32(rounded.astype(np.uint32))


def _dq2(word: np.ndarray, s: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w4m::dq2``: the (low, high) bf16 weights of one register as float32 (fma rounds once)."""
    v = (word & 0x000F000F) | 0x43004300
    s64, b64 = s.astype(np.float64), b.astype(np.float64)
    ns = _round_bf16(-128.0 * s64).astype(np.float64)  # neg128: exact
    res = []
    for half in (v & 0xFFFF, v >> 16):
        vv = _bf16_bits_to_f32(half).astype(np.float64)  # 128 + q
        sq = _round_bf16(vv * s64 + ns).astype(np.float64)
        res.append(_round_bf16(sq * 1.0 + b64))
    return res[0], res[1]


def emulate(x: mx.array, w: Packed, p: Plan) -> np.ndarray:
    """The kernel's result in float32 [M, N], computed through its per-lane index math.

    Mirrors SOURCE: the x chunk copy to shared memory (LDS stride, zero rows past M), ``ldmatrix.x4``'s
    row addresses, the ring loads (word index, sb index, group), ``dq2`` on ``w >> 0/4/8/12`` and the mma
    fragment layouts of m16n8k16 (A: a0 (g, 2t..), a1 (g+8, ..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); B: b0
    k 2t..2t+1, b1 k 2t+8..; both at column g; C: c0 c1 (g, 2t..), c2 c3 (g+8, ..)), then the C store."""
    wq, sb, group_size = w.wq, w.sb, w.group_size
    xn = np.array(x.astype(mx.float32))
    wqn = np.array(wq).reshape(-1)
    sbn = np.array(sb.astype(mx.float32)).reshape(-1)
    sb_bits = np.array(sb.view(mx.uint16)).reshape(-1).astype(np.uint32)
    assert np.array_equal(_bf16_bits_to_f32(sb_bits), sbn)
    m, k = xn.shape
    nblk = wq.shape[0]
    n = nblk * 16
    kb_steps, groups = k // 64, k // group_size
    gps = 1 if group_size >= 64 else 64 // group_size
    rows = p.mt * 16
    lds = CH * 64 + 8
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    gx, gy, gz = p.grid(m, n)
    split = p.splits > 1
    reduce = split and p.reduce
    out = np.full((m, n), np.nan, np.float32)  # an output no lane writes stays NaN
    ws = np.full((p.splits, m, n), np.nan, np.float32)
    n_ctas = gy
    for bx in range(gx // (32 * p.warps)):
        m0 = bx * rows
        for z in range(gz):
            s_lo, s_hi = z * kb_steps // gz, (z + 1) * kb_steps // gz
            # every warp of every CTA along N at once: nb0 per (cta, warp)
            nb0 = ((np.arange(n_ctas)[:, None] * p.warps + np.arange(p.warps)[None, :]) * p.nb).reshape(-1)
            acc = np.zeros((nb0.size, p.mt, p.nb, 2, 32, 4), np.float32)
            for c0 in range(s_lo, s_hi, CH):
                cols8 = (min(c0 + CH, s_hi) - c0) * 8
                xs = np.zeros((rows * lds,), np.float32)
                ii = np.arange(rows * CH * 8)  # the copy loop's i over all threads, 8 elements (16 bytes) each
                rr, cc = ii // (CH * 8), ii % (CH * 8)
                ok = (m0 + rr < m) & (cc < cols8)
                e = np.arange(8)
                dst_idx = (rr * lds + cc * 8)[ok][:, None] + e
                xs[dst_idx] = xn[(m0 + rr)[ok][:, None], (c0 * 64 + cc * 8)[ok][:, None] + e]
                for pp in range(CH):
                    step = c0 + pp
                    if step >= s_hi:
                        continue
                    nb = np.minimum(nb0[:, None] + np.arange(p.nb)[None, :], nblk - 1)  # [W, NB]
                    widx = ((nb[..., None] * kb_steps + step) * 32 + lane) * 4  # [W, NB, 32] (uint4 -> words)
                    for kk in range(4):
                        # ldmatrix.x4: lane l gives row (l & 15), column + (l >> 4) * 8 of matrix l >> 3;
                        # register r of lane l = matrix r's row l >> 2, columns 2 (l & 3), +1
                        a = np.zeros((p.mt, 32, 4, 2), np.float32)
                        for i in range(p.mt):
                            addr_row = i * 16 + (lane & 15)
                            addr_col = pp * 64 + kk * 16 + (lane >> 4) * 8
                            addrs = addr_row * lds + addr_col  # element address given by each lane
                            for r in range(4):
                                src = addrs[r * 8 + (lane >> 2)] + 2 * t
                                a[i, :, r, 0] = xs[src]
                                a[i, :, r, 1] = xs[src + 1]
                        word = wqn[widx + kk]  # [W, NB, 32]
                        gi = 0 if gps == 1 else (kk * 16) // group_size
                        grp = (step * 64 + gi * group_size) // group_size
                        sidx = ((nb[..., None] * groups + grp) * 8 + g) * 4  # bf16 index of the uint2
                        s_lo2, b_lo2 = sbn[sidx], sbn[sidx + 1]
                        s_hi2, b_hi2 = sbn[sidx + 2], sbn[sidx + 3]
                        breg = [
                            _dq2(word, s_lo2, b_lo2),
                            _dq2(word >> 4, s_lo2, b_lo2),
                            _dq2(word >> 8, s_hi2, b_hi2),
                            _dq2(word >> 12, s_hi2, b_hi2),
                        ]
                        # rebuild the tiles the fragments describe, then C = A @ B per the mma's definition
                        at = np.zeros((p.mt, 16, 16), np.float32)
                        for r in range(4):
                            rr = g + 8 * (r & 1)
                            cc = 2 * t + 8 * (r >> 1)
                            at[:, rr, cc] = a[:, :, r, 0]
                            at[:, rr, cc + 1] = a[:, :, r, 1]
                        for h in range(2):
                            bt = np.zeros(nb.shape + (16, 8), np.float32)
                            for r in range(2):
                                lo, hi = breg[2 * h + r]
                                bt[..., 2 * t + 8 * r, g] = lo
                                bt[..., 2 * t + 8 * r + 1, g] = hi
                            ct = np.einsum("imk,wjkn->wijmn", at, bt)  # [W, MT, NB, 16, 8]
                            acc[:, :, :, h, :, 0] += ct[..., g, 2 * t]
                            acc[:, :, :, h, :, 1] += ct[..., g, 2 * t + 1]
                            acc[:, :, :, h, :, 2] += ct[..., g + 8, 2 * t]
                            acc[:, :, :, h, :, 3] += ct[..., g + 8, 2 * t + 1]
            # store (C fragment positions)
            dst = ws[z] if split else out
            for w_i, base_nb in enumerate(nb0):
                for i in range(p.mt):
                    r0 = m0 + i * 16 + g
                    for j in range(p.nb):
                        if base_nb + j >= nblk:
                            continue
                        for h in range(2):
                            col = (base_nb + j) * 16 + h * 8 + 2 * t
                            c = acc[w_i, i, j, h]
                            ok0, ok1 = r0 < m, r0 + 8 < m
                            dst[r0[ok0], col[ok0]] = c[ok0, 0]
                            dst[r0[ok0], col[ok0] + 1] = c[ok0, 1]
                            dst[r0[ok1] + 8, col[ok1]] = c[ok1, 2]
                            dst[r0[ok1] + 8, col[ok1] + 1] = c[ok1, 3]
        if split and reduce:
            # the last CTA of each tile (bx, by): its column pairs, the slices added in order
            pairs = p.warps * p.nb * 8
            ii = np.arange(rows * pairs)
            for by in range(gy):
                rr = m0 + ii // pairs
                col = by * p.warps * p.nb * 16 + 2 * (ii % pairs)
                ok = (rr < m) & (col < n)
                for half in (0, 1):
                    v = np.zeros(int(ok.sum()), np.float32)
                    for zz in range(gz):
                        v += ws[zz, rr[ok], col[ok] + half]
                    out[rr[ok], col[ok] + half] = v
    return ws.sum(axis=0) if split and not reduce else out


def emulate_native(x: mx.array, w: Native, p: Plan) -> np.ndarray:
    """The native kernel's result in float32 [M, N], computed through its per-lane index math.

    Mirrors NATIVE_SOURCE: each step's cp.async copies into the swizzled shared layouts (zero rows past
    M, weight rows past N clamped), ``ldmatrix.x4``'s row addresses over the weights and the word each
    lane receives, the 16-byte activation loads and their ``prmt`` pairs, the scale and bias indices,
    ``dq2`` on ``w >> 8u`` and ``w >> (8u + 4)``, the m16n8k16 fragment layouts, the C store and the
    split-K reduction."""
    gs = w.group_size
    xn = np.array(x.astype(mx.float32))
    wn = np.array(w.w).reshape(-1)
    scn = np.array(w.scales.astype(mx.float32)).reshape(-1)
    bin_ = np.array(w.biases.astype(mx.float32)).reshape(-1)
    m, k = xn.shape
    n, kw = w.n, k // 8
    nblk, kb_steps, groups = n // 16, k // 64, k // gs
    gps = 1 if gs >= 64 else 64 // gs
    rows, nc = p.mt * 16, p.warps * p.nb * 16
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    gx, gy, gz = p.grid(m, n)
    split = p.splits > 1
    reduce = split and p.reduce
    out = np.full((m, n), np.nan, np.float32)
    ws = np.full((p.splits, m, n), np.nan, np.float32)
    # every warp of every CTA along N at once: W = gy * warps
    by = np.repeat(np.arange(gy), p.warps)
    warp = np.tile(np.arange(p.warps), gy)
    nb0 = (by * p.warps + warp) * p.nb
    jj = np.arange(p.nb)
    for bx in range(gx // (32 * p.warps)):
        m0 = bx * rows
        for z in range(gz):
            s_lo, s_hi = z * kb_steps // gz, (z + 1) * kb_steps // gz
            acc = np.zeros((by.size, p.mt, p.nb, 2, 32, 4), np.float32)
            for step in range(s_lo, s_hi):
                # activations: unit u (8 bf16) of row r at unit r * 8 + (u ^ 4 (r & 1))
                xs = np.zeros((rows * 64,), np.float32)
                r, u = np.meshgrid(np.arange(rows), np.arange(8), indexing="ij")
                ok = m0 + r < m
                e8 = np.arange(8)
                dst = ((r * 8 + (u ^ ((r & 1) << 2))) * 8)[ok][:, None] + e8
                xs[dst] = xn[(m0 + r)[ok][:, None], (step * 64 + u * 8)[ok][:, None] + e8]
                # weights: unit u (4 words) of CTA row r at unit r * 2 + (u ^ ((r >> 2) & 1)), per CTA
                wsm = np.zeros((gy, nc * 8), np.uint32)
                r, u = np.meshgrid(np.arange(nc), np.arange(2), indexing="ij")
                e4 = np.arange(4)
                dst = ((r * 2 + (u ^ ((r >> 2) & 1))) * 4).reshape(-1)[:, None] + e4
                for cta in range(gy):
                    src_row = np.minimum(cta * nc + r, n - 1)
                    wsm[cta][dst] = wn[(src_row * kw + step * 8 + u * 4).reshape(-1)[:, None] + e4]
                # ldmatrix.x4: lane L addresses row L & 7 of matrix L >> 3; lane l gets word l & 3 of row l >> 2
                mi = lane >> 3
                rr = (warp[:, None, None] * p.nb + jj[None, :, None]) * 16 + 8 * (mi >> 1) + (lane & 7)  # [W, NB, 32]
                addr = (rr * 2 + ((mi & 1) ^ ((rr >> 2) & 1))) * 4  # word address each lane gives
                bw = np.zeros((by.size, p.nb, 32, 4), np.uint32)
                for i in range(4):
                    src = addr[:, :, i * 8 + g] + t  # [W, NB, 32]
                    bw[..., i] = wsm[by[:, None, None], src]
                # scales: outputs min(nb0 + j, NBLK - 1) * 16 + g (+ 8)
                nrow = np.minimum(nb0[:, None] + jj[None, :], nblk - 1)[..., None] * 16 + g  # [W, NB, 32]
                for c32 in range(2):
                    # A: 16 bytes of row r (and r + 8) at unit (4 c32 + t) ^ 4 (r & 1); prmt pairs
                    a = np.zeros((p.mt, 2, 4, 32, 2), np.float32)  # [i, u, reg, lane, (lo, hi)]
                    for i in range(p.mt):
                        r0 = i * 16 + g
                        uu = (c32 * 4 + t) ^ ((r0 & 1) << 2)
                        lo = xs[((r0 * 8 + uu) * 8)[:, None] + e8]  # [32, 8]
                        hi = xs[(((r0 + 8) * 8 + uu) * 8)[:, None] + e8]
                        for uq in range(2):
                            for reg, (src, off) in enumerate(((lo, 0), (hi, 0), (lo, 1), (hi, 1))):
                                a[i, uq, reg, :, 0] = src[:, 2 * uq + off]  # 0x5410 / 0x7632: word u, low/high
                                a[i, uq, reg, :, 1] = src[:, 2 * uq + 4 + off]  # word u + 2
                    gi = 0 if gps == 1 else c32
                    o = nrow * groups + (step * 64 + gi * gs) // gs
                    for h in range(2):
                        s_, b_ = scn[o + 8 * h * groups], bin_[o + 8 * h * groups]
                        wv = bw[..., h * 2 + c32]
                        for uq in range(2):
                            b0 = _dq2(wv >> np.uint32(8 * uq), s_, b_)
                            b1 = _dq2(wv >> np.uint32(8 * uq + 4), s_, b_)
                            at = np.zeros((p.mt, 16, 16), np.float32)
                            for reg in range(4):
                                ar, ac = g + 8 * (reg & 1), 2 * t + 8 * (reg >> 1)
                                at[:, ar, ac] = a[:, uq, reg, :, 0]
                                at[:, ar, ac + 1] = a[:, uq, reg, :, 1]
                            bt = np.zeros((by.size, p.nb, 16, 8), np.float32)
                            for reg, (blo, bhi) in enumerate((b0, b1)):
                                bt[..., 2 * t + 8 * reg, g] = blo
                                bt[..., 2 * t + 8 * reg + 1, g] = bhi
                            ct = np.einsum("imk,wjkn->wijmn", at, bt)
                            acc[:, :, :, h, :, 0] += ct[..., g, 2 * t]
                            acc[:, :, :, h, :, 1] += ct[..., g, 2 * t + 1]
                            acc[:, :, :, h, :, 2] += ct[..., g + 8, 2 * t]
                            acc[:, :, :, h, :, 3] += ct[..., g + 8, 2 * t + 1]
            _store(out, ws[z] if split else out, acc, nb0, m0, m, nblk, p)
        if split and reduce:
            _reduce(out, ws, m0, m, n, gy, gz, p)
    return ws.sum(axis=0) if split and not reduce else out


def _store(
    out: np.ndarray, dst: np.ndarray, acc: np.ndarray, nb0: np.ndarray, m0: int, m: int, nblk: int, p: Plan
) -> None:
    """The C fragments' store: lane (g, t) of block j, half h writes rows g, g + 8, columns 2t, 2t + 1."""
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    for w_i, base_nb in enumerate(nb0):
        for i in range(p.mt):
            r0 = m0 + i * 16 + g
            for j in range(p.nb):
                if base_nb + j >= nblk:
                    continue
                for h in range(2):
                    col = (base_nb + j) * 16 + h * 8 + 2 * t
                    c = acc[w_i, i, j, h]
                    ok0, ok1 = r0 < m, r0 + 8 < m
                    dst[r0[ok0], col[ok0]] = c[ok0, 0]
                    dst[r0[ok0], col[ok0] + 1] = c[ok0, 1]
                    dst[r0[ok1] + 8, col[ok1]] = c[ok1, 2]
                    dst[r0[ok1] + 8, col[ok1] + 1] = c[ok1, 3]


def _reduce(out: np.ndarray, ws: np.ndarray, m0: int, m: int, n: int, gy: int, gz: int, p: Plan) -> None:
    """The last CTA of each tile: its column pairs, the slices added in order."""
    rows, pairs = p.mt * 16, p.warps * p.nb * 8
    ii = np.arange(rows * pairs)
    for by in range(gy):
        rr = m0 + ii // pairs
        col = by * p.warps * p.nb * 16 + 2 * (ii % pairs)
        ok = (rr < m) & (col < n)
        for half in (0, 1):
            v = np.zeros(int(ok.sum()), np.float32)
            for zz in range(gz):
                v += ws[zz, rr[ok], col[ok] + half]
            out[rr[ok], col[ok] + half] = v
