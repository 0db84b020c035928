"""Decode's own dense matrix-vector arithmetic, run on several rows in one pass over the weights.

Why: ``qmv_rows`` makes the ``mirrored`` level cheap for quantized models. A dense (bf16, fp16 or
fp32) model's projections had no such kernel, so a verify block at ``mirrored`` ran decode's own
one-row call once per row, and a burst round of the demo pair cost more classic steps than its
tokens saved.

On MLX CUDA a one-row projection without a bias (``x @ W.T`` with one row: classic decode's call)
runs MLX's ``gemv``: 8 warps a block, one warp per output feature, each lane walking the input
features ``n`` at a time (4 where K is a multiple of 128, 2 where of 64, else 1) and adding
``float(w) * float(x)`` into one fp32 sum, then the warp's lanes summed with cooperative groups'
``reduce`` and the sum rounded to the output dtype. This kernel performs that same sequence for up
to ``MAX_ROWS`` rows at once, each row with its own sum, sharing each weight load between the rows.

Whether it reproduces MLX's one-row call is measured, never assumed: every weight shape and dtype is
checked at first use against MLX's own call on each of 5 random rows, byte for byte (``_matches``); a
shape that differs in any byte (or a kernel that does not compile) keeps decode's own one-row call
per row, which is exact by construction, and the probe verifies the level end to end like any other.
A projection with a bias is not taken (MLX runs it through cuBLAS with the bias fused, not ``gemv``).

Switch: ``rowkernel.implementation()`` (``MLX_BATCHD_ROWKERNEL``), as for ``qmv_rows``: with
``reference`` (CPU tests) every row takes decode's one-row call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from workers.kernels import jit_cache, rowkernel
from workers.kernels.byte_equal import bytes_equal

log = logging.getLogger("mlx_batchd.gemv_rows")

#: Rows per kernel call (a longer block runs in calls of this many; each row is unaffected).
MAX_ROWS = 8
#: Warps per block, one output feature each (MLX's ``rows_per_block``).
WARPS = 8

_HEADER = """
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
"""

#: Template: T the dtype, M rows, NP input features a lane takes per iteration (MLX's ``n_per_thread``).
_SOURCE = """
  namespace cg = cooperative_groups;
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int K = static_cast<int>(x_shape[1]);
  const int N = static_cast<int>(w_shape[0]);
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  if (row < N) {
    float sums[M];
    #pragma unroll
    for (int m = 0; m < M; ++m) sums[m] = 0.0f;
    for (int col = NP * static_cast<int>(warp.thread_rank()); col < K; col += 32 * NP) {
      T wv[NP];
      #pragma unroll
      for (int j = 0; j < NP; ++j) wv[j] = w[(size_t)row * K + col + j];
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int j = 0; j < NP; ++j) {
          sums[m] += static_cast<float>(wv[j]) * static_cast<float>(x[(size_t)m * K + col + j]);
        }
      }
    }
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      const float s = cg::reduce(warp, sums[m], cg::plus<float>{});
      if (warp.thread_rank() == 0) out[(size_t)m * N + row] = static_cast<T>(s);
    }
  }
"""

_kernel: Any = None
#: (out features, in features, dtype) -> whether the kernel reproduced MLX's one-row call.
_matches_mlx: dict[tuple[Any, ...], bool] = {}
#: Whether the kernel compiled (``None`` until first tried).
_compiled: bool | None = None


def per_lane(k: int) -> int:
    """Input features a lane takes per iteration, by MLX's rule for aligned buffers."""
    return 4 if k % 128 == 0 else 2 if k % 64 == 0 else 1


def covered(module: Any, x: mx.array) -> mx.array | None:
    """The weight ((out, in), row-major) when the kernel takes ``module`` on rows like ``x``: a dense
    ``Linear`` without a bias or a tied ``Embedding``'s linear use, floating weights of ``x``'s dtype,
    2-D rows."""
    if type(module) not in (nn.Linear, nn.Embedding) or x.ndim != 2 or "bias" in module:
        return None
    w = module["weight"]
    if w.ndim != 2 or w.dtype != x.dtype or x.dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return None
    return w if w.shape[1] == x.shape[1] else None


#: Launch arguments by (rows, weight shape, dtype): worked out once, not on every projection call.
_plans: dict[tuple[Any, ...], dict[str, Any]] = {}


def _launch(x: mx.array, w: mx.array) -> mx.array:
    """``x``'s rows (at most ``MAX_ROWS``) against ``w`` in one kernel call."""
    global _kernel
    if _kernel is None:
        _kernel = jit_cache.cuda_kernel(
            name="mlx_batchd_gemv_rows", input_names=["x", "w"], output_names=["out"], source=_SOURCE, header=_HEADER
        )
    key = (x.shape[0], w.shape[0], w.shape[1], x.dtype)
    kwargs = _plans.get(key)
    if kwargs is None:
        m, n = int(x.shape[0]), int(w.shape[0])
        kwargs = _plans[key] = {
            "template": [("T", x.dtype), ("M", m), ("NP", per_lane(int(w.shape[1])))],
            "grid": (-(-n // WARPS) * 32, WARPS, 1),
            "threadgroup": (32, WARPS, 1),
            "output_shapes": [(m, n)],
            "output_dtypes": [x.dtype],
        }
        jit_cache.prime(_kernel, [x, w], kwargs["template"], kwargs["output_dtypes"])
    return _kernel(inputs=[x, w], **kwargs)[0]


def _matches(module: Any, original: Callable[..., mx.array], w: mx.array, dtype: Any) -> bool:
    """The kernel on 5 random rows and on each row alone, against MLX's own one-row call of
    ``module`` on each row (the call ``original`` makes for classic decode), byte for byte."""
    global _compiled
    k = int(w.shape[1])
    x = (mx.random.normal((5, k), key=mx.random.key(k + int(w.shape[0]))) * 0.5).astype(dtype)
    rows = [mx.contiguous(x[i : i + 1]) for i in range(5)]
    try:
        five = _launch(x, w)
        ones = [_launch(r, w) for r in rows]
        mlx_rows = [original(module, r[None]).reshape(1, -1) for r in rows]
        mx.eval(five, ones, mlx_rows)
        _compiled = True
    except Exception as exc:
        log.warning("the dense mirrored kernel is unavailable: %s", exc)  # every shape on the fallback
        _compiled = False
        return False
    return all(bytes_equal(five[i : i + 1], mlx_rows[i]) and bytes_equal(ones[i], mlx_rows[i]) for i in range(5))


def project(module: Any, original: Callable[..., mx.array], x: mx.array) -> mx.array | None:
    """``module``'s projection of ``x``'s rows (shape (rows, in)) through the kernel, in calls of at
    most ``MAX_ROWS`` rows, or ``None`` where the module, its shape or this backend is not covered
    (the caller then makes decode's own one-row call per row)."""
    if _compiled is False:
        return None
    w = covered(module, x)
    if w is None:
        return None
    key = (w.shape[0], w.shape[1], x.dtype)
    ok = _matches_mlx.get(key)
    if ok is None:
        # The switch is read here, on a shape's first call, not on every call.
        if rowkernel.implementation() != "cuda":
            return None
        ok = _matches_mlx[key] = _matches(module, original, w, x.dtype)
        log.info(
            "dense mirrored kernel on %s: %s", key, "matches MLX's one-row call" if ok else "differs; one-row calls"
        )
    if not ok:
        return None
    if x.shape[0] <= MAX_ROWS:
        return _launch(x, w)
    return mx.concatenate([_launch(x[i : i + MAX_ROWS], w) for i in range(0, x.shape[0], MAX_ROWS)], axis=0)


def report() -> dict[str, bool]:
    """Which weight shapes the kernel reproduced MLX's one-row call on."""
    return {repr(k): v for k, v in _matches_mlx.items()}
