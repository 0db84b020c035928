"""The CUDA text of the w4a16 tensor-core GEMM (``w4a16`` builds and launches it).

``HEADER`` holds the device helpers (the MMA, ``ldmatrix``, the bf16x2 dequantization that gives MLX's
dequantize bit for bit, ``cp.async``); ``NATIVE_SOURCE`` the kernel body, reading MLX's packed 4-bit
arrays as they are; ``EPILOGUE`` the C store and the deterministic split-K reduction; ``TILES`` the
launch shapes the calibration times against each other.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

HEADER = r"""
#undef FP_NAN
#undef FP_INFINITE
#undef FP_ZERO
#undef FP_SUBNORMAL
#undef FP_NORMAL

// One m16n8k16 MMA with fp32 accumulators, and one packed-pair FMA, in the 16-bit type DT ("bf16", "f16").
#define W4M_MMA16816(DT)                                                                    \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." DT "." DT ".f32 "                 \
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                   \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                            \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
#define W4M_FMA2(DT) asm("fma.rn." DT "x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c))

namespace w4m {

__device__ __forceinline__ void mma_bf16_16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  W4M_MMA16816("bf16");
}

__device__ __forceinline__ void ldsm_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t bfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  W4M_FMA2("bf16");
  return d;
}

// Two weights of one word: nibbles j (low half) and j + 4 (high half), shifted down by 4 * j before
// the call. (q | 0x4300) as bf16 is v = 128 + q, and v - 128 is q exactly; fma(q, s, b) then rounds
// once: bit for bit MLX CUDA's dequantize, whose `scale * q + bias` compiles to one bf16 FMA (MLX's CPU
// backend rounds the product and the sum apart, one bf16 ulp away at some weights).
__device__ __forceinline__ uint32_t dq2(uint32_t w, uint32_t s2, uint32_t b2) {
  const uint32_t v = (w & 0x000f000fu) | 0x43004300u;
  return bfma2(bfma2(v, 0x3f803f80u, 0xc300c300u), s2, b2);
}

// 16 bytes global -> shared, bypassing L1; zero-filled when !ok (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// The same for float16 activations, scales and biases: the MMA in float16, and dq2 with float16's
// constants ((q | 0x6400) as float16 is 1024 + q; one float16 FMA with the scale and bias).
__device__ __forceinline__ void mma_f16_16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  W4M_MMA16816("f16");
}

__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  W4M_FMA2("f16");
  return d;
}

__device__ __forceinline__ uint32_t dq2h(uint32_t w, uint32_t s2, uint32_t b2) {
  const uint32_t v = (w & 0x000f000fu) | 0x64006400u;
  return hfma2(hfma2(v, 0x3c003c00u, 0xe400e400u), s2, b2);
}

// By the activations' dtype T (__nv_bfloat16 or __half): the MMA, the dequantization, a pair's store.
template <typename T>
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (cuda::std::is_same_v<T, __half>) {
    mma_f16_16816(c, a, b0, b1);
  } else {
    mma_bf16_16816(c, a, b0, b1);
  }
}

template <typename T>
__device__ __forceinline__ uint32_t dq2t(uint32_t w, uint32_t s2, uint32_t b2) {
  if constexpr (cuda::std::is_same_v<T, __half>) {
    return dq2h(w, s2, b2);
  } else {
    return dq2(w, s2, b2);
  }
}

template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  if constexpr (cuda::std::is_same_v<T, __half>) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  }
}

}  // namespace w4m
"""

#: The thread's place in the launch (after a body's M, K, N, NBLK, KB, G, ROWS): its warp and lane, the
#: lane's (g, t) in the MMA fragments, the CTA's first row and the warp's first 16-output block, and its
#: K slice [s_lo, s_hi) of KB k64 steps, one of S (gridDim.z). ``EPILOGUE`` reads these names too.
TILE_INDEX = r"""
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
"""

#: The C fragments' store and the split-K reduction (names a kernel body defines: acc, m0, nb0, NBLK, N,
#: M, g, t, z, S, out, ws, locks). ``benchmarks/w4a16_marlin.py``'s repacked layout ends with it too.
EPILOGUE = r"""
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
          if (r0 < M) w4m::store2(out + (size_t)r0 * N + n, c[0], c[1]);
          if (r0 + 8 < M) w4m::store2(out + (size_t)(r0 + 8) * N + n, c[2], c[3]);
        }
      }
    }
  }

  // Several K slices, REDUCE: the last CTA of a tile to finish (a counter a tile in ``locks``, which it
  // resets to zero) adds the slices' partials in slice order and writes the output's dtype: deterministic.
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
        w4m::store2(out + (size_t)r * N + n, v.x, v.y);
      }
    }
    if (threadIdx.x == 0) lk[tile] = 0;
  }
"""

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

#: Template: T, MT, NB, WARPS, STAGES (k64 steps in flight, 2-4), GS, SPLIT, REDUCE. Inputs x, w (MLX's
#: packed uint32 [N, K/8]), scales, biases (bf16 [N, K/gs]), locks; outputs out (bf16 [M, N]),
#: ws (fp32 [S, M, N] partials when SPLIT). Grid: (row tiles * 32 * WARPS, CTAs along N, K slices) threads.
#:
#: Each k64 step, the CTA copies its activations (``16 * MT`` rows of 128 bytes) and its outputs' packed
#: words (``16 * NB * WARPS`` rows of 32 bytes, MLX's row-major layout) to shared memory with 16-byte
#: cp.async, STAGES - 1 steps ahead. Shared layouts (16-byte units, XOR-swizzled so that every 8-lane
#: phase touches 8 distinct units): activation row r's unit u sits at r * 8 + (u ^ 4 (r & 1)); weight row
#: r's unit u at r * 2 + (u ^ ((r >> 2) & 1)). ``ldmatrix.x4`` over the weights hands lane (g, t) word t
#: of row g of each 16-byte unit: the eight nibbles of K 8t..8t+7 of one k32 half. The MMAs take K in the
#: order that suits this word: MMA u (0, 1) of a k32 half has B fragments (nibbles 2u, 2u + 4) and
#: (2u + 1, 2u + 5), dequantized by ``w4m::dq2`` on ``w >> 8u`` and ``w >> (8u + 4)`` (MLX CUDA's bits); the lane's A fragments are the same K of its activation rows: one 16-byte shared load of
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
"""
    + TILE_INDEX
    + r"""  const int n_cta = blockIdx.y * NC;

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
      const T* src = ok ? x + (size_t)(m0 + r) * K + (size_t)step * 64 + u * 8 : x;
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
              const uint32_t wv = bw[j][h * 2 + c32];
#pragma unroll
              for (int u = 0; u < 2; ++u) {
                const uint32_t b0 = w4m::dq2t<T>(wv >> (8 * u), s2, b2);       // nibbles 2u, 2u+4
                const uint32_t b1 = w4m::dq2t<T>(wv >> (8 * u + 4), s2, b2);   // nibbles 2u+1, 2u+5
#pragma unroll
                for (int i = 0; i < MT; ++i) w4m::mma16816<T>(acc[i][j][h], a[i][u], b0, b1);
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
    + EPILOGUE
)

NATIVE_INPUT_NAMES = ["x", "w", "scales", "biases", "locks"]
OUTPUT_NAMES = ["out", "ws"]


class Tile(NamedTuple):
    """Fields forced on ``w4a16.plan`` (``None``: the plan's own choice)."""

    mt: int | None = None
    nb: int | None = None
    reduce: bool = True
    #: The fewest k64 steps a K slice: more means fewer slices, and less for the reduction to add.
    min_steps: int = 2


#: Tiles the calibration times against each other at ``TILE_ROWS`` rows and more: the fields each
#: forces on ``w4a16.plan`` (the first is ``plan``'s own). A 128-row tile (``mt`` 8) dequantizes each
#: weight once for twice the rows of a 64-row one; one 16-output block a warp (``nb`` 1) halves its
#: registers; ``reduce`` off adds the K slices with an MLX sum instead of the tile's last CTA; ``min_steps``
#: 8 caps the K slices where outputs are few (at 32 rows k/v's 32 slices of two steps each left one CTA a
#: tile adding 512 KB of partials: Nsight Compute timed the launch longer than q/o's, at a quarter of the
#: weights).
TILES: tuple[Tile, ...] = (
    Tile(),
    Tile(mt=8),
    Tile(mt=8, nb=1),
    Tile(reduce=False),
    Tile(mt=8, reduce=False),
    Tile(mt=8, nb=1, reduce=False),
    Tile(min_steps=8),
    Tile(nb=1, min_steps=8),
)
#: Row counts from which the calibration times every tile in ``TILES`` (below it, ``plan``'s own).
TILE_ROWS = 32
#: A thread's register cap by (``mt``, ``nb``, warps) where the project compiles the kernel (absent: the
#: compiler's choice). An SM holds 64K registers: four 128-thread CTAs fit at 128 a thread, three at 168.
REGISTER_CAPS: dict[tuple[int, int, int], int] = {}


def variant() -> str:
    """A short hash of the kernel's text, its tiles, the rows they are timed from and its register caps:
    stored plans that chose it are timed again when any of them changes."""
    return hashlib.sha256(
        (NATIVE_HEADER + NATIVE_SOURCE + repr((TILES, TILE_ROWS, sorted(REGISTER_CAPS.items())))).encode()
    ).hexdigest()[:16]
