"""The CUDA text of ``workers.kernels.sdpa_rows``' kernels: MLX CUDA's vector attention kernels (one pass, and
the two passes beyond ``sdpa_rows.ONE_PASS_KEYS`` keys) for several queries of one sequence, each query
over its own key count.

Kept apart from the Python that checks and launches them (``workers.kernels.sdpa_rows``), so that each file holds
one job; ``tools/nvrtc/check.py`` compiles the same text off the GPU.
"""

from __future__ import annotations

HEADER = """
#include <cooperative_groups/reduce.h>
"""

# MLX's kernel_sdpav_1pass (no sinks, not causal) for the query blockIdx.y over its own key count.
ONE_PASS = """
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
PASS_1 = """
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
PASS_2 = """
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
