"""An experiment: MLX's own sm80 quantized main loop launched with tiles sized for decode's row counts.

MLX CUDA runs a batched affine-quantized matmul on Hopper with one CTA per 128 output features and
copies the scales and biases transposed on every call, so a projection of 4,096 outputs occupies 32
of the GPU's 132 SMs. This module launches MLX's own sm80 main loop (``qmm_sm80_mainloop``: weights
dequantized in registers, ``mma.sync`` bf16/fp16 tensor-core tiles, a cp.async pipeline) through
``mx.fast.cuda_kernel`` with tiles sized so that every projection fills the GPU: ``BM`` rows by ``BN``
outputs a CTA (``tiles``). ``w4a16_probe.py`` measures it against MLX's quantized matmul and a bf16
copy, and checks it against a float32 reference: within bounds on the shapes checked, but no faster than MLX's own
kernel (docs/benchmarks.md, "Batched projections on tensor cores"), so the engine does not use it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

#: Threads a CTA: the main loop's tiled MMA is four warps whatever the tile.
THREADS = 128
#: K elements a pipeline stage (the main loop's shared-memory swizzle is 64 wide).
BK = 64
#: Pipeline stages of the main loop (its shared-memory layouts are built for three).
STAGES = 3

HEADER = """
#undef FP_NAN
#undef FP_INFINITE
#undef FP_ZERO
#undef FP_SUBNORMAL
#undef FP_NORMAL
// The custom kernel's prelude declares ``mlx::core::cu::Shape``, which hides ``cute::Shape`` inside
// the main loop's namespace: cute is included first, then the name is pointed at cute's for the loop.
#include "mlx/backend/cuda/device/cute_dequant.cuh"
#define Shape cute::Shape
#include "mlx/backend/cuda/device/qmm_sm80.cuh"
#undef Shape

template <typename T> struct w4_elem;
template <> struct w4_elem<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct w4_elem<__half> { using type = cutlass::half_t; };
template <int BITS> struct w4_quant;
template <> struct w4_quant<4> { using type = cutlass::uint4b_t; };
template <> struct w4_quant<8> { using type = uint8_t; };
"""

#: One CTA: rows ``blockIdx.x * BM ..`` of ``x`` against outputs ``blockIdx.y * BN ..`` of the
#: weight, through MLX's main loop (which predicates the rows past ``m``).
SOURCE = """
  using namespace cute;
  using Element = typename w4_elem<T>::type;
  using Quant = typename w4_quant<BITS>::type;
  const int m = x_shape[0];
  const int k = x_shape[1];
  const int n = scales_shape[0];
  auto cta_tiler = make_shape(Int<BM>{}, Int<BN>{}, Int<BKT>{});
  const int m_coord = blockIdx.x;
  const int n_coord = blockIdx.y;
  Tensor mA = make_tensor(make_gmem_ptr(reinterpret_cast<const Element*>(x)), make_shape(m, k),
                          make_stride(k, Int<1>{}));
  Tensor mB = make_tensor(make_gmem_ptr<Quant>(reinterpret_cast<const void*>(w)), make_shape(n, k),
                          make_stride(k, Int<1>{}));
  Tensor mC = make_tensor(make_gmem_ptr(reinterpret_cast<Element*>(out)), make_shape(m, n),
                          make_stride(n, Int<1>{}));
  auto s_layout = make_layout(make_shape(n, make_shape(Int<GS>{}, k / GS)),
                              make_stride(k / GS, Stride<_0, _1>{}));
  Tensor mS = make_tensor(make_gmem_ptr(reinterpret_cast<const Element*>(scales)), s_layout);
  Tensor mZ = make_tensor(make_gmem_ptr(reinterpret_cast<const Element*>(biases)), s_layout);
  auto cta_coord = make_coord(m_coord, n_coord, _);
  Tensor gA = local_tile(mA, cta_tiler, cta_coord, Step<_1, X, _1>{});
  Tensor gB = local_tile(mB, cta_tiler, cta_coord, Step<X, _1, _1>{});
  Tensor gC = local_tile(mC, cta_tiler, cta_coord, Step<_1, _1, X>{});
  Tensor gS = local_tile(mS, cta_tiler, cta_coord, Step<X, _1, _1>{});
  Tensor gZ = local_tile(mZ, cta_tiler, cta_coord, Step<X, _1, _1>{});
  mlx::core::cu::qmm_sm80_mainloop(cta_tiler, gA, gB, gS, gZ, gC, m - BM * m_coord, int(threadIdx.x));
"""

_kernels: dict[tuple[int, int, int], Any] = {}


def available() -> bool:
    """Whether the kernel can run here: MLX's CUDA backend on the default device."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def shared_bytes(bm: int, bn: int, bk: int, bits: int, elem_bytes: int = 2) -> int:
    """The main loop's dynamic shared memory: the pipelined A and B tiles, or the C tile it stages
    the output through (a union), whichever is larger."""
    mainloop = STAGES * bk * (bm * elem_bytes + bn * bits // 8)
    return max(mainloop, bm * bn * elem_bytes)


def tiles(m: int, n: int, bm: int | None = None, bn: int | None = None) -> tuple[int, int]:
    """(BM, BN) for ``m`` rows and ``n`` outputs (either may be forced). The main loop's layouts take
    BN in {64, 128} and BM in {16, 32, 64}. By default the row tile is the smallest of 16/32/64 that
    holds the rows (more rows take more row tiles) and the output tile is 128 where that still gives
    a large GPU two CTAs an SM, else 64."""
    if bm is None:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
    if bn is None:
        bn = 128 if n % 128 == 0 and -(-m // bm) * (n // 128) >= 264 else 64
    return bm, bn


def _kernel(bm: int, bn: int, bk: int, bits: int) -> Any:
    key = (bm, bn, bk * 16 + bits)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = mx.fast.cuda_kernel(
            name=f"mlx_batchd_w4a16_{bm}_{bn}_{bk}_{bits}",
            input_names=["x", "w", "scales", "biases"],
            output_names=["out"],
            source=SOURCE,
            header=HEADER,
            shared_memory=shared_bytes(bm, bn, bk, bits),
        )
    return kernel


def matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    bits: int,
    group_size: int,
    bm: int | None = None,
    bn: int | None = None,
) -> mx.array:
    """``x @ dequantize(w).T`` for 2-D ``x`` (rows, K), through the tensor-core main loop."""
    m = x.shape[0]
    n = scales.shape[0]
    bm, bn = tiles(m, n, bm, bn)
    bk = max(BK, group_size)
    kernel = _kernel(bm, bn, bk, bits)
    return kernel(
        inputs=[x, w, scales, biases],
        template=[("T", x.dtype), ("BM", bm), ("BN", bn), ("BKT", bk), ("GS", group_size), ("BITS", bits)],
        grid=(-(-m // bm) * THREADS, n // bn, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
    )[0]
