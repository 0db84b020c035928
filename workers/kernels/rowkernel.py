"""The project's row-exact projection kernel: a few rows through one pass over the weights, each row
reduced in one fixed order whatever the number of rows in the call.

Why: a verify block of K + 1 tokens is exact when each of its rows is computed as classic decode
computes that row. MLX CUDA's small-row quantized matmul is row-exact up to 7 rows but runs as one
matrix-vector product per row (5 rows: 2.4x the cost of one), and its batched kernel (8+ rows) is
not row-exact with one row. This kernel reads each weight once for up to ``MAX_ROWS`` rows and
accumulates every row with the same chain of fp32 fused multiply-adds (then the same warp
butterfly), so row ``m`` of a call is bit-for-bit the one-row call on that row: a verify block and
the classic steps that it stands for are equal by construction once both go through it (the
``rowwise`` level pins both, as ``padded`` does).

Covered: 4-bit and 8-bit affine ``QuantizedLinear`` / ``QuantizedEmbedding.as_linear`` and dense
``Linear`` / ``Embedding.as_linear`` with bf16, fp16 or fp32 activations whose scales (or weights)
share their dtype. ``project`` answers ``None`` for anything else, and the level falls back to
decode's own one-row call for that module, which is exact by construction too.

One switch (``implementation``): the CUDA kernel where MLX runs on CUDA; ``MLX_BATCHD_ROWKERNEL=
reference`` selects a plain-MLX implementation of the same arithmetic anywhere (what CPU tests run,
and what the device check compares the kernel against); ``=off`` disables the level.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from workers import envs
from workers.kernels import jit_cache

log = logging.getLogger("mlx_batchd.rowkernel")

#: Rows per kernel call; a longer block runs in calls of this many (each row is unaffected).
MAX_ROWS = 8
#: Output features per warp: each warp keeps its rows of ``x`` in registers for this many weight rows.
OUTS_PER_WARP = 4
#: Quantized words each lane loads at once (1, or 4: one 128-bit load) where a weight row's word count
#: allows it. Both settings sum each row in one fixed order per layer shape, whatever the row count;
#: they differ in speed only (``benchmarks/rowkernel_probe.py`` measures both).
VECTOR_WORDS = 1
#: Threads per block (four warps).
BLOCK = 128

_HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float rk_f(float v) { return v; }
__device__ __forceinline__ float rk_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float rk_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T rk_to(float v);
template <> __device__ __forceinline__ float rk_to<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 rk_to<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half rk_to<__half>(float v) { return __float2half_rn(v); }
"""

#: Shared by both kernels: each warp takes R consecutive outputs and keeps M x R fp32 sums ...
_ACCUMULATORS = """\
  const int lane = threadIdx.x & 31;
  const int n0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  if (n0 >= N) return;
  float acc[M][R];
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
  }
"""

#: ... and reduces each sum with the same warp butterfly, lane 0 writing it: one fixed order per row.
_REDUCE_AND_WRITE = """\
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = n0 + r;
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = acc[m][r];
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0 && n < N) out[(size_t)m * N + n] = rk_to<T>(v);
    }
  }
"""

#: Quantized (affine): out[m, n] = sum_k x[m, k] * (scale[n, k / GS] * q[n, k] + bias[n, k / GS]).
#: Template ints: M rows, GS group size, BITS (4 or 8), R outputs per warp, VEC words per load (a lane
#: sums words ci * VEC .. ci * VEC + VEC - 1 in turn); K (in) and N (out) come from the shapes at run
#: time, so a process compiles one kernel per row count, not per layer shape. Warps past the last
#: output recompute the last one and write nothing.
_QUANT_SOURCE = (
    """\

  constexpr int PER_WORD = 32 / BITS;
  const int K = static_cast<int>(x_shape[1]);
  const int N = static_cast<int>(w_shape[0]);
  const int WORDS = K / PER_WORD;
  const int GROUPS = K / GS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
"""
    + _ACCUMULATORS
    + """\
  for (int ci = lane; ci < WORDS / VEC; ci += 32) {
    uint32_t qs[R][VEC];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const int n = n0 + r < N ? n0 + r : N - 1;
      if (VEC == 4) {
        const uint4 v = reinterpret_cast<const uint4*>(w + (size_t)n * WORDS)[ci];
        qs[r][0] = v.x; qs[r][1] = v.y; qs[r][2] = v.z; qs[r][3] = v.w;
      } else {
        #pragma unroll
        for (int t = 0; t < VEC; ++t) qs[r][t] = w[(size_t)n * WORDS + ci * VEC + t];
      }
    }
    #pragma unroll
    for (int t = 0; t < VEC; ++t) {
      const int wi = ci * VEC + t;
      float xs[M][PER_WORD];
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int j = 0; j < PER_WORD; ++j) xs[m][j] = rk_f(x[(size_t)m * K + (size_t)wi * PER_WORD + j]);
      }
      const int g = (wi * PER_WORD) / GS;
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        const int n = n0 + r < N ? n0 + r : N - 1;
        const float s = rk_f(scales[(size_t)n * GROUPS + g]);
        const float b = rk_f(biases[(size_t)n * GROUPS + g]);
        #pragma unroll
        for (int j = 0; j < PER_WORD; ++j) {
          const float wd = __fmaf_rn((float)((qs[r][t] >> (BITS * j)) & MASK), s, b);
          #pragma unroll
          for (int m = 0; m < M; ++m) acc[m][r] = __fmaf_rn(xs[m][j], wd, acc[m][r]);
        }
      }
    }
  }
"""
    + _REDUCE_AND_WRITE
)

#: Dense: out[m, n] = sum_k x[m, k] * w[n, k]. Template ints: M, R; K and N from the shapes.
_DENSE_SOURCE = (
    """\

  constexpr int PER_STEP = 8;
  const int K = static_cast<int>(x_shape[1]);
  const int N = static_cast<int>(w_shape[0]);
  const int STEPS = K / PER_STEP;
"""
    + _ACCUMULATORS
    + """\
  for (int si = lane; si < STEPS; si += 32) {
    float xs[M][PER_STEP];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      #pragma unroll
      for (int j = 0; j < PER_STEP; ++j) xs[m][j] = rk_f(x[(size_t)m * K + (size_t)si * PER_STEP + j]);
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const int n = n0 + r;
      if (n < N) {
        #pragma unroll
        for (int j = 0; j < PER_STEP; ++j) {
          const float wv = rk_f(w[(size_t)n * K + (size_t)si * PER_STEP + j]);
          #pragma unroll
          for (int m = 0; m < M; ++m) acc[m][r] = __fmaf_rn(xs[m][j], wv, acc[m][r]);
        }
      }
    }
  }
"""
    + _REDUCE_AND_WRITE
)

_kernels: dict[str, Any] = {}
#: The CUDA kernel's start-up check (``usable``): ``None`` until run.
_checked: bool | None = None


def implementation() -> str | None:
    """``"cuda"``, ``"reference"`` or ``None`` (the level is unavailable): the one switch."""
    forced = envs.read(envs.ROWKERNEL)
    if forced:
        return None if forced == "off" else forced
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        return "cuda"
    return None


def usable() -> bool:
    """Whether the level can run here: an implementation is selected and, for the CUDA kernel, it
    compiled and passed a small check against the reference at first use (fail closed: a kernel
    that does not build or does not agree leaves the ladder without ``rowwise``)."""
    global _checked
    impl = implementation()
    if impl != "cuda":
        return impl is not None
    if _checked is None:
        try:
            _checked = self_check()
        except Exception as exc:  # a JIT failure must not take the probe down
            log.warning("the row-exact kernel is unavailable: %s", exc)
            _checked = False
    return _checked


def self_check(seed: int = 0) -> bool:
    """The kernel against the reference on small random layers (quantized 4-bit and dense): close in
    value, and each row of a 5-row call byte-equal to the 1-row call on that row."""
    key = mx.random.key(seed)
    ok = True
    for module in (nn.QuantizedLinear(256, 72, bits=4, group_size=64), nn.Linear(256, 72, bias=False)):
        module.set_dtype(mx.bfloat16)
        x = mx.random.normal((5, 256), key=key).astype(mx.bfloat16)
        found = _weights(module)
        assert found is not None
        kind, weights, n, extra = found
        five = _launch(kind, [x, *weights], 5, n, extra)
        ones = [_launch(kind, [x[i : i + 1], *weights], 1, n, extra) for i in range(5)]
        ref = _reference(kind, x, weights, extra)
        mx.eval(five, ones, ref)
        close = bool(mx.allclose(five.astype(mx.float32), ref.astype(mx.float32), rtol=2e-2, atol=2e-2).item())
        exact = all(
            bool(mx.array_equal(five[i : i + 1].view(mx.uint16), ones[i].view(mx.uint16)).item()) for i in range(5)
        )
        if not (close and exact):
            log.warning("the row-exact kernel failed its check on %s: close=%s, row-exact=%s", kind, close, exact)
            ok = False
    return ok


def _kernel(kind: str) -> Any:
    if kind not in _kernels:
        quant = kind == "quant"
        _kernels[kind] = jit_cache.cuda_kernel(
            name=f"mlx_batchd_rowwise_{kind}",
            input_names=["x", "w", "scales", "biases"] if quant else ["x", "w"],
            output_names=["out"],
            source=_QUANT_SOURCE if quant else _DENSE_SOURCE,
            header=_HEADER,
        )
    return _kernels[kind]


def _launch(kind: str, inputs: list[mx.array], m: int, n: int, extra: dict[str, int]) -> mx.array:
    x = inputs[0]
    warps = -(-n // OUTS_PER_WARP)
    template: list[tuple[str, Any]] = [("T", x.dtype), ("M", m), ("R", OUTS_PER_WARP), *extra.items()]
    if kind == "quant":
        words = inputs[1].shape[1]
        template.append(("VEC", VECTOR_WORDS if words % VECTOR_WORDS == 0 else 1))
    kernel = _kernel(kind)
    jit_cache.prime(kernel, inputs, template, [x.dtype])
    out = kernel(
        inputs=inputs,
        template=template,
        grid=(warps * 32, 1, 1),
        threadgroup=(BLOCK, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
    )
    return out[0]


def _quantized(module: Any) -> tuple[mx.array, mx.array, mx.array, int, int] | None:
    """(weight, scales, biases, bits, group size) of an affine quantized module this kernel covers."""
    biases = module.get("biases")
    if getattr(module, "mode", "affine") != "affine" or biases is None or module.bits not in (4, 8):
        return None
    return module["weight"], module["scales"], biases, int(module.bits), int(module.group_size)


def _weights(module: Any) -> tuple[str, tuple[mx.array, ...], int, dict[str, int]] | None:
    """(kind, weight arrays, out features, template extras) for ``module``, or ``None``."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        q = _quantized(module)
        if q is None:
            return None
        w, s, b, bits, gs = q
        return "quant", (w, s, b), int(w.shape[0]), {"BITS": bits, "GS": gs}
    if isinstance(module, (nn.Linear, nn.Embedding)):
        w = module["weight"]
        return "dense", (w,), int(w.shape[0]), {}
    return None


def _reference(kind: str, x: mx.array, weights: tuple[mx.array, ...], extra: dict[str, int]) -> mx.array:
    """The same sums in plain MLX: fp32 dequantized weights, fp32 products, one row at a time."""
    if kind == "quant":
        w, s, b = weights
        dense = mx.dequantize(w, s, b, group_size=extra["GS"], bits=extra["BITS"]).astype(mx.float32)
    else:
        dense = weights[0].astype(mx.float32)
    rows = [x[i : i + 1].astype(mx.float32) @ dense.T for i in range(x.shape[0])]
    return mx.concatenate(rows, axis=0).astype(x.dtype)


def _covers(found: tuple[str, tuple[mx.array, ...], int, dict[str, int]], x: mx.array) -> bool:
    """Whether the kernel takes rows like ``x`` for a module whose weights are ``found``: 2-D, dtype
    shared with the weights' scales or weights, in features a multiple of the kernel's step."""
    if x.ndim != 2 or x.dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return False
    kind, weights, _, extra = found
    k = x.shape[1]
    if kind == "quant":
        per_word = 32 // extra["BITS"]
        return weights[1].dtype == x.dtype and k % per_word == 0 and k % extra["GS"] == 0
    return weights[0].dtype == x.dtype and k % 8 == 0


def supported(module: Any, x: mx.array) -> bool:
    """Whether ``project`` takes ``module`` on rows like ``x``."""
    found = _weights(module)
    return found is not None and _covers(found, x)


def project(module: Any, x: mx.array) -> mx.array | None:
    """``x @ W.T (+ bias)`` for ``x`` of shape (rows, in), through the row-exact kernel in calls of at
    most ``MAX_ROWS`` rows; ``None`` when the module or the rows are not covered (or the level is off)."""
    impl = implementation()
    found = None if impl is None else _weights(module)
    if found is None or not _covers(found, x) or not usable():
        return None
    kind, weights, n, extra = found
    parts = []
    for i in range(0, x.shape[0], MAX_ROWS):
        xs = x[i : i + MAX_ROWS]
        if impl == "cuda":
            parts.append(_launch(kind, [xs, *weights], xs.shape[0], n, extra))
        else:
            parts.append(_reference(kind, xs, weights, extra))
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    if isinstance(module, (nn.Linear, nn.QuantizedLinear)) and "bias" in module:
        out = out + module["bias"]
    return out
