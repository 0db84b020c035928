"""MLX's 4-bit affine dequantize as a project kernel on MLX CUDA, bit for bit ``mx.dequantize``.

``dequant_matmul`` writes a projection's weight before each large-batch product, so this pass is
paid every step; it moves about four times the 4-bit bytes. Each thread dequantizes four packed words
(32 weights), a warp 128 consecutive words, so that each store is 512 contiguous bytes a warp, with
``w4a16``'s one-FMA-a-pair dequantization (``w4m::dq2t``: bf16, or float16 scales as a GGUF model loads
on a GPU), which gives MLX CUDA's dequantize bit for bit in bf16
(``tests/gpu``). A shape's first call is compared with ``mx.dequantize`` and MLX's kept where they
differ. Elsewhere, and for what it does not take (8 bits, scales other than bf16 or float16),
``mx.dequantize``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from workers.kernels import jit_cache
from workers.kernels.w4a16_source import HEADER as W4M_HEADER

log = logging.getLogger("mlx_batchd")

#: Threads a block.
THREADS = 256
#: The scales' dtypes it takes (its output's dtype is theirs).
DTYPES = (mx.bfloat16, mx.float16)

HEADER = (
    W4M_HEADER
    + r"""
namespace w4d {

// One packed word's eight weights in order (16 bytes) in the scales' dtype T: dq2t gives weights
// (j, j + 4) of w >> 4j.
template <typename T>
__device__ __forceinline__ uint4 word8(uint32_t w, uint32_t s2, uint32_t b2) {
  const uint32_t r0 = w4m::dq2t<T>(w, s2, b2);
  const uint32_t r1 = w4m::dq2t<T>(w >> 4, s2, b2);
  const uint32_t r2 = w4m::dq2t<T>(w >> 8, s2, b2);
  const uint32_t r3 = w4m::dq2t<T>(w >> 12, s2, b2);
  return make_uint4(__byte_perm(r0, r1, 0x5410), __byte_perm(r2, r3, 0x5410), __byte_perm(r0, r1, 0x7632),
                    __byte_perm(r2, r3, 0x7632));
}

// A group's scale or bias in both halves of a register.
__device__ __forceinline__ uint32_t both(const void* a, size_t i) {
  const uint32_t v = reinterpret_cast<const unsigned short*>(a)[i];
  return v | (v << 16);
}

}  // namespace w4d
"""
)

SOURCE = r"""
  const int N = w_shape[0];
  const int KW = w_shape[1];               // packed words a row
  const int G = KW * 8 / GS;
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  // A warp's 128 consecutive words, word i * 32 + lane for the lane's i-th.
  const long long base = (t >> 5) * 128 + (t & 31);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const long long wi = base + i * 32;
    if (wi >= (long long)N * KW) return;
    const int row = (int)(wi / KW);
    const int c = (int)(wi % KW);
    const size_t gi = (size_t)row * G + (size_t)(c * 8 / GS);
    reinterpret_cast<uint4*>(out)[wi] = w4d::word8<T>(w[wi], w4d::both(scales, gi), w4d::both(biases, gi));
  }
"""

_kernel: list[Any] = []


def takes(w: mx.array, scales: mx.array, bits: int, group_size: int) -> bool:
    """Whether the kernel runs this weight here: MLX CUDA (or ``launch_seam`` set), 4 bits, bf16 or
    float16 scales, groups of 32-128, rows of whole 16-byte quads."""
    here = launch_seam is not None or (mx.default_device() == mx.gpu and mx.cuda.is_available())
    return here and (
        bits == 4
        and scales.dtype in DTYPES
        and group_size in (32, 64, 128)
        and w.ndim == 2
        and w.shape[1] % 4 == 0
        and (w.shape[1] * 8) % group_size == 0
    )


#: (rows, packed words a row, group size, scales' dtype) -> whether the kernel gave ``mx.dequantize``'s
#: bits at its first call on that shape in this process (checked on the weight it was called with).
_checked: dict[tuple[int, int, int, mx.Dtype], bool] = {}


def dequantize(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """``mx.dequantize(w, scales, biases, group_size, bits)``: through the kernel where it ``takes`` the
    weight and its first call on the weight's shape gave ``mx.dequantize``'s bits, else MLX's own (fail
    closed: a shape that differed, or could not be checked, keeps MLX's)."""
    if not takes(w, scales, bits, group_size):
        return mx.dequantize(w, scales, biases, group_size, bits)
    key = (w.shape[0], w.shape[1], group_size, scales.dtype)
    ok = _checked.get(key)
    if ok is False:
        return mx.dequantize(w, scales, biases, group_size, bits)
    out = launch(w, scales, biases, group_size)
    if ok is None:
        want = mx.dequantize(w, scales, biases, group_size, bits)
        try:
            ok = bool(mx.array_equal(out.view(mx.uint16), want.view(mx.uint16)).item())
        except Exception:  # evaluated where a value cannot be read (a compiled graph): check another time
            return want
        _checked[key] = ok
        if not ok:
            log.warning("dequantize kernel: differs from mx.dequantize at %s; MLX's is used there", key)
            return want
    return out


#: Test seam: when set, runs in place of the CUDA launch (``(w, scales, biases, group_size) -> out``).
launch_seam: Callable[[mx.array, mx.array, mx.array, int], mx.array] | None = None


def launch(w: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> mx.array:
    """The kernel on ``w`` (``takes`` it): [N, K] in the scales' dtype."""
    if launch_seam is not None:
        return launch_seam(w, scales, biases, group_size)
    if not _kernel:
        _kernel.append(
            jit_cache.cuda_kernel(
                name="mlx_batchd_dequant4",
                input_names=["w", "scales", "biases"],
                output_names=["out"],
                source=SOURCE,
                header=HEADER,
            )
        )
    kernel = _kernel[0]
    n, kw = w.shape
    template = [("T", scales.dtype), ("GS", group_size)]
    jit_cache.prime(kernel, [w, scales, biases], template, [scales.dtype])
    threads = n * (kw // 4)  # four words a thread
    return kernel(
        inputs=[w, scales, biases],
        template=template,
        grid=(-(-threads // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(n, kw * 8)],
        output_dtypes=[scales.dtype],
    )[0]
