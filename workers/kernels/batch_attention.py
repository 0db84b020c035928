"""Batched decode's attention in one kernel: each sequence's one query over its own unmasked keys.

A batch's cache (mlx-lm's ``BatchKVCache``) left-pads shorter sequences and hands attention a boolean
mask. MLX CUDA's fused one-query attention takes no array mask, so a masked batch falls back to separate
score, select, softmax and value kernels (about a fifth of a B = 128 step on the 8B: docs/benchmarks.md).
This kernel is MLX CUDA's one-pass vector attention (``sdpa_source.ONE_PASS``'s arithmetic) with a block
per (head, sequence) that skips the keys its row of the mask leaves out. Batched decode makes no
byte-identity promise, but the kernel fails closed: its first call on a (heads, KV heads, head dim,
dtype) in a process is compared with MLX's own call on the same inputs, and MLX's is kept where the
kernel's output is off by more than bf16 attention allows. Decode steps of two or more sequences at the
``wide`` level only, where ``MLX_BATCHD_BATCH_ATTENTION=1`` turns it on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from workers import envs
from workers.api import Level
from workers.kernels import jit_cache
from workers.kernels.levels import current_level

log = logging.getLogger("mlx_batchd")

HEADER = """
#include <cooperative_groups/reduce.h>
"""

#: One block of 32 warps per (head, sequence): warp w takes keys w, w + 32, ... of its sequence whose mask
#: entry is set (a whole warp skips or takes a key, so the warp's reductions stay uniform), keeps a running
#: maximum and sum as MLX's one-pass kernel does, and the block combines its warps' partial outputs.
SOURCE = """
  constexpr int BN = 32;
  constexpr int BD = 32;
  constexpr int v_per_thread = D / BD;
  typedef float U;
  const int H = queries_shape[1];
  const int kH = keys_shape[1];
  const int kL = keys_shape[2];
  const int inner_k_stride = BN * int(keys_strides[2]);
  const int inner_v_stride = BN * int(values_strides[2]);

  U q[v_per_thread];
  U k[v_per_thread];
  U o[v_per_thread];

  __shared__ U outputs[BN][BD + 1];
  __shared__ U max_scores[BN];
  __shared__ U sum_exp_scores[BN];

  const U scale_log2 = scale[0] * 1.4426950408889634074;

  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane_idx = warp.thread_rank();
  const int warp_idx = warp.meta_group_rank();

  const int head_idx = blockIdx.x;
  const int b = blockIdx.z;
  const int kv_head_idx = head_idx / (H / kH);
  const int kv_seq_idx = warp_idx;

  const T* Q = queries + b * queries_strides[0] + head_idx * queries_strides[1];
  const T* K = keys + b * keys_strides[0] + kv_head_idx * keys_strides[1] + kv_seq_idx * keys_strides[2];
  const T* V = values + b * values_strides[0] + kv_head_idx * values_strides[1] + kv_seq_idx * values_strides[2];
  const bool* row = mask + (size_t)b * kL;
  const int64_t qd = queries_strides[3];
  const int64_t kd = keys_strides[3];
  const int64_t vd = values_strides[3];
  T* O = out + (size_t)(b * H + head_idx) * D;

  #pragma unroll
  for (int i = 0; i < v_per_thread; i++) {
    q[i] = scale_log2 * static_cast<U>(Q[(v_per_thread * lane_idx + i) * qd]);
  }
  #pragma unroll
  for (int i = 0; i < v_per_thread; i++) {
    o[i] = 0.f;
  }

  U max_score = Limits<U>::finite_min();
  U sum_exp_score = 0.f;

  for (int i = kv_seq_idx; i < kL; i += BN) {
    if (row[i]) {
      #pragma unroll
      for (int j = 0; j < v_per_thread; j++) {
        k[j] = K[(v_per_thread * lane_idx + j) * kd];
      }
      U score = 0.f;
      #pragma unroll
      for (int j = 0; j < v_per_thread; j++) {
        score += q[j] * k[j];
      }
      score = cg::reduce(warp, score, cg::plus<U>());
      U new_max = max(max_score, score);
      U factor = exp2f(max_score - new_max);
      U exp_score = exp2f(score - new_max);
      max_score = new_max;
      sum_exp_score = sum_exp_score * factor + exp_score;
      #pragma unroll
      for (int j = 0; j < v_per_thread; j++) {
        o[j] = o[j] * factor + exp_score * static_cast<U>(V[(v_per_thread * lane_idx + j) * vd]);
      }
    }
    K += inner_k_stride;
    V += inner_v_stride;
  }

  if (lane_idx == 0) {
    max_scores[warp_idx] = max_score;
    sum_exp_scores[warp_idx] = sum_exp_score;
  }
  block.sync();

  max_score = max_scores[lane_idx];
  U new_max = cg::reduce(warp, max_score, cg::greater<U>());
  U factor = exp2f(max_score - new_max);
  sum_exp_score = cg::reduce(warp, sum_exp_scores[lane_idx] * factor, cg::plus<U>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);

  #pragma unroll
  for (int i = 0; i < v_per_thread; i++) {
    outputs[lane_idx][warp_idx] = o[i];
    block.sync();
    U ot = outputs[warp_idx][lane_idx] * factor;
    o[i] = cg::reduce(warp, ot, cg::plus<U>()) * sum_exp_score;
    block.sync();
  }

  if (lane_idx == 0) {
    #pragma unroll
    for (int i = 0; i < v_per_thread; i++) {
      O[v_per_thread * warp_idx + i] = static_cast<T>(o[i]);
    }
  }
"""

HEAD_DIMS = (64, 96, 128, 256)
#: How far the kernel's output may be from MLX's own call at its first use, as a share of the largest
#: value magnitude: bf16 attention outputs differ by a few bf16 ulps (2^-8 relative) between kernels; a
#: key or a head taken wrong is off by the values' own size.
TOLERANCE = 2.0**-5

_kernel: list[Any] = []
_scales: dict[float, mx.array] = {}
#: (query heads, KV heads, head dim, dtype) -> whether the kernel's first call there agreed with MLX's.
_checked: dict[tuple[Any, ...], bool] = {}

#: Test seam: when set, runs in place of the CUDA launch (``(queries, keys, values, mask, scale) -> out``).
launch_seam: Callable[[mx.array, mx.array, mx.array, mx.array, float], mx.array] | None = None


def takes(queries: mx.array, keys: mx.array, values: mx.array, mask: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the kernel runs this call: switched on, MLX CUDA (or ``launch_seam``), a decode step of two
    or more sequences (one query each) at ``wide`` with a boolean mask of one row a sequence, a head
    dimension MLX's vector kernel takes, whole groups of query heads per KV head, no extra arguments."""
    if envs.switch(envs.BATCH_ATTENTION) is not True:
        return False
    here = launch_seam is not None or (mx.default_device() == mx.gpu and mx.cuda.is_available())
    if not here or kwargs or not isinstance(mask, mx.array) or mask.dtype != mx.bool_:
        return False
    b, heads, n, dim = queries.shape if queries.ndim == 4 else (0, 0, 0, 0)
    return (
        b >= 2
        and n == 1
        and dim in HEAD_DIMS
        and keys.ndim == values.ndim == 4
        and keys.shape[0] == values.shape[0] == b
        and keys.shape[3] == values.shape[3] == dim
        and heads % keys.shape[1] == 0
        and keys.dtype == values.dtype == queries.dtype
        and queries.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and mask.size == b * keys.shape[2]
        and mask.shape[0] == b
        and current_level() is Level.WIDE
    )


def attend(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)`` for a call
    ``takes`` took: (B, H, 1, D). Through the kernel where its first call on these heads agreed with MLX's."""
    key = (queries.shape[1], keys.shape[1], queries.shape[3], queries.dtype)
    ok = _checked.get(key)
    if ok is False:
        return _mlx(queries, keys, values, mask, scale)
    out = launch(queries, keys, values, mask, scale)
    if ok is None:
        want = _mlx(queries, keys, values, mask, scale)
        err = mx.max(mx.abs(out.astype(mx.float32) - want.astype(mx.float32)))
        try:
            ok = bool((err <= TOLERANCE * mx.max(mx.abs(values.astype(mx.float32)))).item())
        except Exception:  # evaluated where a value cannot be read (a compiled graph): check another time
            return want
        _checked[key] = ok
        if not ok:
            log.warning("batched attention kernel: off from MLX's by %s at %s; MLX's is used there", err, key)
            return want
    return out


def _mlx(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float) -> mx.array:
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def launch(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float) -> mx.array:
    """The kernel on a call ``takes`` took: (B, H, 1, D)."""
    if launch_seam is not None:
        return launch_seam(queries, keys, values, mask, scale)
    if not _kernel:
        _kernel.append(
            jit_cache.cuda_kernel(
                name="mlx_batchd_batch_attention",
                input_names=["queries", "keys", "values", "mask", "scale"],
                output_names=["out"],
                source=SOURCE,
                header=HEADER,
                ensure_row_contiguous=False,  # reads the cache's views where they are (strides): no copies
            )
        )
    b, heads, _, dim = queries.shape
    rows = mx.contiguous(mask.reshape(b, keys.shape[2]))
    s = _scales.get(scale)
    if s is None:
        s = _scales[scale] = mx.array([scale], dtype=mx.float32)
    template = [("T", queries.dtype), ("D", dim)]
    inputs = [queries, keys, values, rows, s]
    jit_cache.prime(_kernel[0], inputs, template, [queries.dtype])
    return _kernel[0](
        inputs=inputs,
        template=template,
        grid=(heads * 1024, 1, b),
        threadgroup=(1024, 1, 1),
        output_shapes=[(b, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )[0]
