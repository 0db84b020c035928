"""Decode's attention for several queries of one sequence in one launch (MLX CUDA).

Classic decode attends one query at a time with MLX CUDA's vector attention kernel: one pass over the
keys up to 1,024 of them, two passes beyond. Each warp of that kernel takes every 32nd key (every 256th
in the two-pass kernel, 32 blocks of 8 warps) in order, whatever the key count, and the warps' partial
sums are then reduced in a fixed order. A verify block's K + 1 queries attend to 1, 2, ... keys more
than the cached context, so each query reproduces its own decode step if it runs exactly that kernel
over exactly its own key count. MLX itself cannot give that in one call (it sends several queries to
cuDNN, whose reduction differs), so the exact verify called MLX once per query and layer: 160 fused
calls and their views per 5-token block of a 32-layer model, half of a block's graph-building time on
the H200 8B synth.

This module's kernels are MLX's vector kernels (MLX 0.32) with two changes: the grid's second axis runs
over the block's queries and each query's thread block sets its key count to the keys before it and
its own (the first ``keys - queries + 1 + q``); and queries, keys and values are read through their
strides, where they lie (the cache's view of its buffer: no contiguous copies). Inside a thread block
every arithmetic operation, its operands and its order are those of MLX's kernel for one query of
that key count. Whether the device reproduces
MLX's own call byte for byte is measured (``attention._measure``, at first use per shape); where it
does not, the per-query calls stay. Decode steps whose key count is a multiple of 256 may run cuDNN on
MLX CUDA (its rule for a cache's contiguous keys), so those queries attend alone (``ALONE_EVERY``).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from workers import rowkernel

log = logging.getLogger("mlx_batchd.attention")

#: Key counts above this take MLX's two-pass kernel (a group never spans it: ``attention.SPLIT``).
ONE_PASS_KEYS = 1024
#: A query whose decode step saw a multiple of this many keys attends alone (cuDNN may have run it).
ALONE_EVERY = 256
#: Head dimensions MLX's vector kernel takes.
HEAD_DIMS = (64, 96, 128)

_HEADER = """
#include <cooperative_groups/reduce.h>
"""

# MLX's kernel_sdpav_1pass (no sinks, not causal) for the query blockIdx.y over its own key count.
_ONE_PASS = """
  constexpr int BN = 32;
  constexpr int BD = 32;
  constexpr int v_per_thread = D / BD;
  typedef float U;
  const int H = queries_shape[1];
  const int qL = queries_shape[2];
  const int kH = keys_shape[1];
  const int kTotal = keys_shape[2];
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
  const int kv_head_idx = head_idx / (H / kH);
  const int q_seq_idx = blockIdx.y;
  const int kL = kTotal - qL + 1 + q_seq_idx;
  const int kv_seq_idx = warp_idx;

  const T* Q = queries + head_idx * queries_strides[1] + q_seq_idx * queries_strides[2];
  const T* K = keys + kv_head_idx * keys_strides[1] + kv_seq_idx * keys_strides[2];
  const T* V = values + kv_head_idx * values_strides[1] + kv_seq_idx * values_strides[2];
  const int64_t qd = queries_strides[3];
  const int64_t kd = keys_strides[3];
  const int64_t vd = values_strides[3];
  T* O = out + (size_t)(q_seq_idx * H + head_idx) * D;

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

# MLX's kernel_sdpav_2pass_1 (no sinks, not causal), same change.
_PASS_1 = """
  constexpr int BN = 8;
  constexpr int BD = 32;
  constexpr int blocks = 32;
  constexpr int v_per_thread = D / BD;
  typedef float U;
  const int H = queries_shape[1];
  const int qL = queries_shape[2];
  const int kH = keys_shape[1];
  const int kTotal = keys_shape[2];
  const int inner_k_stride = blocks * BN * int(keys_strides[2]);
  const int inner_v_stride = blocks * BN * int(values_strides[2]);

  U q[v_per_thread];
  U k[v_per_thread];
  U o[v_per_thread];

  __shared__ U outputs[BN][BD + 1];
  __shared__ U max_scores[BN];
  __shared__ U sum_exp_scores[BN];

  const U scale_log2 = scale[0] * 1.44269504089f;

  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane_idx = warp.thread_rank();
  const int warp_idx = warp.meta_group_rank();

  const int block_idx = blockIdx.z;
  const int head_idx = blockIdx.x;
  const int kv_head_idx = head_idx / (H / kH);
  const int q_seq_idx = blockIdx.y;
  const int kL = kTotal - qL + 1 + q_seq_idx;
  const int kv_seq_idx = block_idx * BN + warp_idx;

  const T* Q = queries + head_idx * queries_strides[1] + q_seq_idx * queries_strides[2];
  const T* K = keys + kv_head_idx * keys_strides[1] + kv_seq_idx * keys_strides[2];
  const T* V = values + kv_head_idx * values_strides[1] + kv_seq_idx * values_strides[2];
  const int64_t qd = queries_strides[3];
  const int64_t kd = keys_strides[3];
  const int64_t vd = values_strides[3];

  const int p_offset = (head_idx * qL + q_seq_idx) * blocks + block_idx;
  float* P = partials + (size_t)p_offset * D;
  float* S = sums + p_offset;
  float* M = maxs + p_offset;

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

  for (int i = kv_seq_idx; i < kL; i += blocks * BN) {
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
    K += inner_k_stride;
    V += inner_v_stride;
  }

  if (lane_idx == 0) {
    max_scores[warp_idx] = max_score;
    sum_exp_scores[warp_idx] = sum_exp_score;
  }
  block.sync();

  max_score = (lane_idx < BN) ? max_scores[lane_idx] : -1e9;
  U new_max = cg::reduce(warp, max_score, cg::greater<U>());
  U factor = exp2f(max_score - new_max);
  sum_exp_score = (lane_idx < BN) ? sum_exp_scores[lane_idx] : 0.f;
  sum_exp_score = cg::reduce(warp, sum_exp_score * factor, cg::plus<U>());

  if (warp_idx == 0) {
    S[0] = sum_exp_score;
    M[0] = new_max;
  }

  auto ff = exp2f(max_scores[warp_idx] - new_max);
  #pragma unroll
  for (int i = 0; i < v_per_thread; i++) {
    outputs[warp_idx][lane_idx] = o[i] * ff;
    block.sync();
    if (warp_idx == 0) {
      U ot = outputs[0][lane_idx];
      #pragma unroll
      for (int j = 1; j < BN; j++) {
        ot += outputs[j][lane_idx];
        warp.sync();
      }
      o[i] = ot;
    }
    block.sync();
  }

  if (warp_idx == 0) {
    #pragma unroll
    for (int i = 0; i < v_per_thread; i++) {
      P[v_per_thread * lane_idx + i] = o[i];
    }
  }
"""

# MLX's kernel_sdpav_2pass_2, over the queries' partial results.
_PASS_2 = """
  constexpr int BN = 32;
  constexpr int BD = 32;
  constexpr int blocks = 32;
  constexpr int v_per_thread = D / BD;
  typedef float U;
  const int H = partials_shape[1];
  const int qL = partials_shape[2];

  U o[v_per_thread];
  __shared__ U outputs[BN][BD + 1];

  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane_idx = warp.thread_rank();
  const int warp_idx = warp.meta_group_rank();

  const int head_idx = blockIdx.x;
  const int q_seq_idx = blockIdx.y;
  const int p_offset = (head_idx * qL + q_seq_idx) * blocks;
  const float* P = partials + (size_t)p_offset * D + (size_t)warp_idx * D;
  const float* S = sums + p_offset;
  const float* M = maxs + p_offset;
  T* O = out + (size_t)(q_seq_idx * H + head_idx) * D;

  U max_score = M[lane_idx];
  U new_max = cg::reduce(warp, max_score, cg::greater<U>());
  U factor = exp2f(max_score - new_max);
  U sum_exp_score = cg::reduce(warp, S[lane_idx] * factor, cg::plus<U>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);

  #pragma unroll
  for (int i = 0; i < v_per_thread; i++) {
    o[i] = P[v_per_thread * lane_idx + i];
  }
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

# The three bodies above are MLX's three kernels, each kept in MLX's own words and order (with their
# shared key loop written out in each, as MLX writes it) so that they can be read against MLX's source
# line by line: a difference in how a sum is written is a difference in its bytes.
_kernels: dict[str, Any] = {}


def _kernel(name: str) -> Any:
    kernel = _kernels.get(name)
    if kernel is None:
        inputs, outputs, source = {
            "one_pass": (["queries", "keys", "values", "scale"], ["out"], _ONE_PASS),
            "pass_1": (["queries", "keys", "values", "scale"], ["partials", "sums", "maxs"], _PASS_1),
            "pass_2": (["partials", "sums", "maxs"], ["out"], _PASS_2),
        }[name]
        kernel = _kernels[name] = mx.fast.cuda_kernel(
            name=f"mlx_batchd_sdpa_rows_{name}",
            input_names=inputs,
            output_names=outputs,
            source=source,
            header=_HEADER,
            ensure_row_contiguous=False,  # reads the cache's views where they are (strides): no copies
        )
    return kernel


def takes(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether the kernels take these shapes here: MLX CUDA, one sequence, a head dimension MLX's
    vector kernel takes (equal for queries and values), whole groups of query heads per KV head."""
    return (
        rowkernel.implementation() == "cuda"
        and queries.ndim == 4
        and queries.shape[0] == 1
        and queries.shape[3] in HEAD_DIMS
        and queries.shape[3] == keys.shape[3] == values.shape[3]
        and queries.shape[1] % keys.shape[1] == 0
        and queries.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and keys.dtype == values.dtype == queries.dtype
    )


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Attention of ``queries`` (1, H, n, D) over ``keys``/``values`` (1, H_kv, L, D): query i over
    the first ``L - n + 1 + i`` keys, each as MLX's one-query vector call over that many keys
    computes it. All n key counts must be on one side of ``ONE_PASS_KEYS`` (``attention.spans``)."""
    heads, n, dim = queries.shape[1], queries.shape[2], queries.shape[3]
    total = keys.shape[2]
    s = mx.array([scale], dtype=mx.float32)
    template = [("T", queries.dtype), ("D", dim)]
    if total <= ONE_PASS_KEYS:
        (out,) = _kernel("one_pass")(
            inputs=[queries, keys, values, s],
            template=template,
            grid=(heads * 1024, n, 1),
            threadgroup=(1024, 1, 1),
            output_shapes=[(1, n, heads, dim)],
            output_dtypes=[queries.dtype],
        )
    else:
        partials, sums, maxs = _kernel("pass_1")(
            inputs=[queries, keys, values, s],
            template=template,
            grid=(heads * 256, n, 32),
            threadgroup=(256, 1, 1),
            output_shapes=[(1, heads, n, 32, dim), (1, heads, n, 32), (1, heads, n, 32)],
            output_dtypes=[mx.float32] * 3,
        )
        (out,) = _kernel("pass_2")(
            inputs=[partials, sums, maxs],
            template=template,
            grid=(heads * 1024, n, 1),
            threadgroup=(1024, 1, 1),
            output_shapes=[(1, n, heads, dim)],
            output_dtypes=[queries.dtype],
        )
    # Written as (1, n, H, D), as MLX writes its own output: the model's transpose back is free.
    return out.transpose(0, 2, 1, 3)
