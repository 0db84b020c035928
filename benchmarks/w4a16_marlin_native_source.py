"""The CUDA text of the native w4a16 kernel: MLX's packed arrays as they are, no repack (``w4a16_marlin.py``
builds and launches it; the helpers and the store come from ``w4a16_marlin_source.py``)."""

from __future__ import annotations

from w4a16_marlin_source import EPILOGUE, HEADER

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
#: packed uint32 [N, K/8]), scales, biases (bf16 [N, K/gs]), locks; outputs out, ws; grid as SOURCE's.
#:
#: Each k64 step, the CTA copies its activations (``16 * MT`` rows of 128 bytes) and its outputs' packed
#: words (``16 * NB * WARPS`` rows of 32 bytes, MLX's row-major layout) to shared memory with 16-byte
#: cp.async, STAGES - 1 steps ahead. Shared layouts (16-byte units, XOR-swizzled so that every 8-lane
#: phase touches 8 distinct units): activation row r's unit u sits at r * 8 + (u ^ 4 (r & 1)); weight row
#: r's unit u at r * 2 + (u ^ ((r >> 2) & 1)). ``ldmatrix.x4`` over the weights hands lane (g, t) word t
#: of row g of each 16-byte unit: the eight nibbles of K 8t..8t+7 of one k32 half. The MMAs take K in the
#: order that suits this word: MMA u (0, 1) of a k32 half has B fragments (nibbles 2u, 2u + 4) and
#: (2u + 1, 2u + 5), dequantized by ``w4m::dq2`` on ``w >> 8u`` and ``w >> (8u + 4)`` (MLX's bits, as in
#: the repacked kernel); the lane's A fragments are the same K of its activation rows: one 16-byte shared load of
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
    + EPILOGUE
)

NATIVE_INPUT_NAMES = ["x", "w", "scales", "biases", "locks"]
