"""The CUDA text of the repacked w4a16 kernel (``w4a16_marlin.py`` builds and launches it).

``HEADER`` holds the device helpers both kernels use (the MMA, ``ldmatrix``, the bf16x2 dequantization,
``cp.async``), ``SOURCE`` the repacked kernel's body, and ``EPILOGUE`` its C store and split-K reduction,
which the native kernel (``w4a16_marlin_native_source.py``) ends with too.
"""

from __future__ import annotations

#: k64 steps a chunk of activations in shared memory, and steps of weight loads in flight (equal: the
#: register ring's slot is the step's index in its chunk; ``CHK`` in ``SOURCE``).
CH = 4

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

#: The C fragments' store and the split-K reduction, shared by both kernels (names their bodies define:
#: acc, m0, nb0, NBLK, N, M, g, t, z, S, out, ws, locks).
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
"""
    + EPILOGUE
)

INPUT_NAMES = ["x", "wq", "sb", "locks"]
OUTPUT_NAMES = ["out", "ws"]
