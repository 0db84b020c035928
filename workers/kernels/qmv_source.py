"""The CUDA text of ``workers.kernels.qmv_rows``' kernel: decode's one-row quantized arithmetic (MLX's ``qmv``)
for up to ``MAX_ROWS`` rows in one pass over the weights.

Kept apart from the Python that checks, plans and launches it (``workers.kernels.qmv_rows``), so that each file
holds one job; ``tools/nvrtc/check.py`` compiles the same text off the GPU. Template parameters (set by
``qmv_rows._launch``): T the activation dtype, M the rows, GS the group size, BITS, R outputs per warp
and U weight tiles loaded ahead.
"""

from __future__ import annotations

HEADER = """
// MLX's default kernel header brings libcu++'s FP_* classification macros; cutlass declares the same
// names (under NVRTC) as enumerators, so they are dropped first.
#undef FP_NAN
#undef FP_INFINITE
#undef FP_ZERO
#undef FP_SUBNORMAL
#undef FP_NORMAL
#include "mlx/backend/cuda/device/cute_dequant.cuh"
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

template <typename T> struct qr_cutlass;
template <> struct qr_cutlass<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct qr_cutlass<__half> { using type = cutlass::half_t; };
template <int BITS> struct qr_quant { using type = cutlass::integer_subbyte<BITS, false>; };
template <> struct qr_quant<8> { using type = uint8_t; };

// One tile of E weights of one output feature against M rows of x (already in registers), in decode's
// kernel's order: dequantize (convert, times scale, plus bias, each in CT), then one fused
// multiply-add per element into that row's accumulators (CT for 4-bit, fp32 for 8-bit). The weights,
// scale and bias come in already loaded (``qr_tile`` loads them; the main loop loads U tiles ahead).
template <typename CT, typename Q, typename Acc, int E, int M, int BITS>
__device__ __forceinline__ void qr_math(
    const cutlass::Array<CT, E> (&xv)[M], const cutlass::Array<Q, E>& wq, const CT scale, const CT bias,
    cutlass::Array<Acc, E> (&sums)[M]) {
  cutlass::NumericArrayConverter<CT, Q, E> to_ct;
  cutlass::Array<CT, E> wd = to_ct(wq);
  wd = wd * scale + bias;
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    if constexpr (BITS >= 8) {
      cutlass::NumericArrayConverter<float, CT, E> to_f;
      sums[m] = cutlass::fma(to_f(xv[m]), to_f(wd), sums[m]);
    } else {
      sums[m] = cutlass::fma(xv[m], wd, sums[m]);
    }
  }
}

// A tile as whole 16- or 8-byte loads where WIDE (the caller checked the alignment), else as the
// element type's own loads. Why: cutlass's Array is only element-aligned,
// so a plain dereference becomes 4-byte loads, and a warp's 4-byte loads of a lane-strided tile cost
// the L1 eight times the wavefronts of the 16-byte ones: at 5 rows those loads, not the arithmetic,
// set the kernel's time. Only how the bytes arrive changes, never a value.
template <typename A, bool WIDE>
__device__ __forceinline__ A qr_load(const void* p) {
  if constexpr (WIDE && sizeof(A) % 8 == 0) {
    using V = cuda::std::conditional_t<sizeof(A) % 16 == 0, uint4, uint2>;
    V v[sizeof(A) / sizeof(V)];
    #pragma unroll
    for (int i = 0; i < (int)(sizeof(A) / sizeof(V)); ++i) v[i] = reinterpret_cast<const V*>(p)[i];
    A a;
    memcpy(&a, v, sizeof(A));
    return a;
  } else {
    return *reinterpret_cast<const A*>(p);
  }
}

template <typename Q, int E, int BITS, bool WIDE>
__device__ __forceinline__ cutlass::Array<Q, E> qr_weights(const uint8_t* wrow, int idx) {
  return qr_load<cutlass::Array<Q, E>, WIDE>(wrow + (size_t)idx * BITS / 8);
}

template <typename CT, typename Q, typename Acc, int E, int M, int GS, int BITS, bool WIDE>
__device__ __forceinline__ void qr_tile(
    const cutlass::Array<CT, E> (&xv)[M], const uint8_t* wrow, const CT* srow, const CT* brow, int idx,
    cutlass::Array<Acc, E> (&sums)[M]) {
  qr_math<CT, Q, Acc, E, M, BITS>(xv, qr_weights<Q, E, BITS, WIDE>(wrow, idx), srow[idx / GS], brow[idx / GS], sums);
}

// The x tile at idx of each of the M rows, loaded once for the warp's R outputs.
template <typename CT, int E, int M, bool WIDE>
__device__ __forceinline__ void qr_load_x(const CT* x, int k, int idx, cutlass::Array<CT, E> (&xv)[M]) {
  #pragma unroll
  for (int m = 0; m < M; ++m) xv[m] = qr_load<cutlass::Array<CT, E>, WIDE>(x + (size_t)m * k + idx);
}
"""

#: Template ints: M rows, GS group size, BITS (4 or 8), R outputs per warp (each keeps its own sums,
#: in the same order whatever R: only the x tiles are shared), U weight tiles loaded ahead (the
#: order of the arithmetic does not depend on it); T the activation (and scale) dtype. K
#: and N come from the shapes at run time. ``WARPS`` warps per block. The prologue (``ONE`` or
#: ``many``) picks the weight matrix, its output and the warp's first output feature ``n0``; the
#: body is the same for one matrix and for several.
PRELUDE = """
  using CT = typename qr_cutlass<T>::type;
  using Q = typename qr_quant<BITS>::type;
  constexpr int E = BITS <= 4 ? 16 : 8;
  using Acc = cuda::std::conditional_t<(BITS >= 8), float, CT>;
  if (n0 >= N) return;
  const int groups = K / GS;
  const CT* xc = reinterpret_cast<const CT*>(x);
  // Whole 16-byte x loads and 8-byte weight loads where the arrays' alignment allows (``qr_load``):
  // the main loop is compiled both ways and this picks one for the whole call.
  const bool wide = (reinterpret_cast<uintptr_t>(x) & 15) == 0 && K % 8 == 0 &&
                    (reinterpret_cast<uintptr_t>(wp) & 7) == 0 && ((size_t)K * BITS / 8) % 8 == 0;
  const uint8_t* wrow[R];
  const CT* srow[R];
  const CT* brow[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = n0 + r < N ? n0 + r : N - 1;
    wrow[r] = reinterpret_cast<const uint8_t*>(wp) + (size_t)n * ((size_t)K * BITS / 8);
    srow[r] = reinterpret_cast<const CT*>(sp) + (size_t)n * groups;
    brow[r] = reinterpret_cast<const CT*>(bp) + (size_t)n * groups;
  }
  cutlass::Array<Acc, E> sums[R][M];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      #pragma unroll
      for (int i = 0; i < E; ++i) sums[r][m][i] = Acc(0);
    }
  }
  cutlass::Array<CT, E> xv[M];
  constexpr int PER_WARP = 32 * E;
  const int iters = K / PER_WARP;
"""

#: The main loop: U iterations' weight tiles, scales and biases are loaded into registers before any of
#: them is used, so that U loads per output are in flight at once; the arithmetic that follows is the
#: one-at-a-time loop's.
LOOP = """  int it = 0;
  // U iterations' weight tiles, scales and biases are loaded before any of them is used, so that U
  // loads per output are in flight at once; the arithmetic that follows is the one-at-a-time loop's.
  for (; it + U <= iters; it += U) {
    cutlass::Array<Q, E> wq[U][R];
    CT sc[U][R];
    CT bi[U][R];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = lane * E + (it + u) * PER_WARP;
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        wq[u][r] = qr_weights<Q, E, BITS, WIDE>(wrow[r], idx);
        sc[u][r] = srow[r][idx / GS];
        bi[u][r] = brow[r][idx / GS];
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      qr_load_x<CT, E, M, WIDE>(xc, K, lane * E + (it + u) * PER_WARP, xv);
      #pragma unroll
      for (int r = 0; r < R; ++r) qr_math<CT, Q, Acc, E, M, BITS>(xv, wq[u][r], sc[u][r], bi[u][r], sums[r]);
    }
  }
  for (; it < iters; ++it) {
    const int idx = lane * E + it * PER_WARP;
    qr_load_x<CT, E, M, WIDE>(xc, K, idx, xv);
    #pragma unroll
    for (int r = 0; r < R; ++r) qr_tile<CT, Q, Acc, E, M, GS, BITS, WIDE>(xv, wrow[r], srow[r], brow[r], idx, sums[r]);
  }
"""

#: The rest of K (less than one warp's tile).
TAIL = """  const int rest = K % PER_WARP;
  if (rest && lane * E + K - rest < K) {
    const int idx = lane * E + K - rest;
    qr_load_x<CT, E, M, WIDE>(xc, K, idx, xv);
    #pragma unroll
    for (int r = 0; r < R; ++r) qr_tile<CT, Q, Acc, E, M, GS, BITS, WIDE>(xv, wrow[r], srow[r], brow[r], idx, sums[r]);
  }
"""

#: Each output's accumulators summed in fp32 in element order and the warp's lanes in a butterfly
#: (MLX's ``cg::reduce``), written by lane 0.
REDUCE = """  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float s = 0.0f;
      #pragma unroll
      for (int i = 0; i < E; ++i) s += static_cast<float>(sums[r][m][i]);
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0 && n0 + r < N) {
        const CT o = static_cast<CT>(s);
        op[(size_t)m * N + n0 + r] = *reinterpret_cast<const T*>(&o);
      }
    }
  }
"""


def _both_ways(loop: str) -> str:
    """``loop`` and the rest of K in a lambda instantiated with and without wide loads, and the call
    that picks one (a branch per call, not per load)."""
    return (
        "  auto main_loop = [&](auto wide_t) {\n    constexpr bool WIDE = decltype(wide_t)::value;\n"
        + loop
        + TAIL
        + "  };\n  if (wide) main_loop(cuda::std::true_type{}); else main_loop(cuda::std::false_type{});\n"
    )


BODY = PRELUDE + _both_ways(LOOP) + REDUCE


ONE = """
  const int K = static_cast<int>(x_shape[1]);
  const int N = static_cast<int>(w_shape[0]);
  const int lane = threadIdx.x & 31;
  const int n0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  const auto* wp = w;
  const auto* sp = scales;
  const auto* bp = biases;
  auto* op = out;
"""


def many(count: int) -> str:
    """The prologue for ``count`` weight matrices on the same rows (a layer's q/k/v or gate/up): the
    grid's warps cover the first matrix's outputs, then the second's, ...; each warp works in one
    matrix, on the outputs it would have in that matrix's own call."""
    lines = [
        "  const int K = static_cast<int>(x_shape[1]);",
        "  const int lane = threadIdx.x & 31;",
        "  int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;",
        "  const char* wp = nullptr; const char* sp = nullptr; const char* bp = nullptr; T* op = nullptr;",
        "  int N = 0;",
    ]
    for j in range(count):
        lines += [
            "  if (op == nullptr) {",
            f"    const int n = static_cast<int>(w{j}_shape[0]);",
            "    if (warp < (n + R - 1) / R) {",
            f"      wp = reinterpret_cast<const char*>(w{j}); sp = reinterpret_cast<const char*>(scales{j});",
            f"      bp = reinterpret_cast<const char*>(biases{j}); op = out{j}; N = n;",
            "    } else {",
            "      warp -= (n + R - 1) / R;",
            "    }",
            "  }",
        ]
    lines += ["  if (op == nullptr) return;", "  const int n0 = warp * R;"]
    return "\n".join(lines) + "\n"
