"""The CUDA text of the repacked w4a16 kernel (``w4a16_marlin.py`` builds and launches it).

The device helpers, the C store and the split-K reduction are the engine's (``workers.kernels.w4a16_source``,
whose native kernel reads MLX's arrays as they are); ``HEADER`` adds the repacked layout's two loads and
``SOURCE`` is its body.
"""

from __future__ import annotations

from workers.kernels.w4a16_source import EPILOGUE as EPILOGUE
from workers.kernels.w4a16_source import HEADER as _HEADER
from workers.kernels.w4a16_source import OUTPUT_NAMES as OUTPUT_NAMES
from workers.kernels.w4a16_source import TILE_INDEX

#: k64 steps a chunk of activations in shared memory, and steps of weight loads in flight (equal: the
#: register ring's slot is the step's index in its chunk; ``CHK`` in ``SOURCE``).
CH = 4

HEADER = (
    _HEADER
    + r"""
namespace w4m {

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
)

#: Template: T (bf16), MT (16-row tiles a CTA), NB (16-output blocks a warp), WARPS, XB (activation
#: buffers: 2 overlaps the next chunk's copy with this one's MMAs), GS, SPLIT (several K
#: slices: fp32 partials to ``ws`` [S, M, N]), REDUCE (the last CTA of a tile adds them into ``out``; else
#: the caller does). Inputs x, wq, sb, locks (int32, zero between launches); outputs out bf16 [M, N], ws.
#: Grid: (row tiles * 32 * WARPS, CTAs along N, K slices) threads, threadgroup (32 * WARPS, 1, 1).
SOURCE = (
    r"""
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
"""
    + TILE_INDEX
    + r"""

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
            const uint32_t b00 = w4m::dq2(w, s_lo2, b_lo2);        // n8 half 0, k 2t, 2t+1
            const uint32_t b01 = w4m::dq2(w >> 4, s_lo2, b_lo2);   // n8 half 0, k 2t+8, 2t+9
            const uint32_t b10 = w4m::dq2(w >> 8, s_hi2, b_hi2);   // n8 half 1
            const uint32_t b11 = w4m::dq2(w >> 12, s_hi2, b_hi2);
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
"""
    + EPILOGUE
)

INPUT_NAMES = ["x", "wq", "sb", "locks"]
