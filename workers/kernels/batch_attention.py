"""Batched decode's attention in one kernel: each sequence's one query over its own unmasked keys.

A batch's cache (mlx-lm's ``BatchKVCache``) left-pads shorter sequences and hands attention a boolean
mask. MLX CUDA's fused one-query attention takes no array mask, so a masked batch falls back to separate
score, select, softmax and value kernels (docs/benchmarks.md has what they cost).
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
from workers.kernels import jit_cache, sdpa_rows, sdpa_source
from workers.kernels.levels import current_level

log = logging.getLogger("mlx_batchd")

HEADER = sdpa_source.HEADER

#: MLX's one-pass kernel (``sdpa_source.ONE_PASS``, kept there in MLX's own words) with these edits: a block
#: per (head, sequence) instead of per (head, query of one sequence), each sequence over all its cache's keys,
#: and a key its row of the mask leaves out skipped by the whole warp (so the warp's reductions stay uniform).
EDITS = (
    (
        "  const int qL = queries_shape[2];\n",
        "",
    ),
    (
        "  const int kTotal = keys_shape[2];\n",
        "  const int kL = keys_shape[2];\n",
    ),
    (
        "  const int q_seq_idx = blockIdx.y;\n  const int kL = kTotal - qL + 1 + q_seq_idx;\n",
        "  const int b = blockIdx.z;\n",
    ),
    (
        "  const T* Q = queries + head_idx * queries_strides[1] + q_seq_idx * queries_strides[2];\n"
        "  const T* K = keys + kv_head_idx * keys_strides[1] + kv_seq_idx * keys_strides[2];\n"
        "  const T* V = values + kv_head_idx * values_strides[1] + kv_seq_idx * values_strides[2];\n",
        "  const T* Q = queries + b * queries_strides[0] + head_idx * queries_strides[1];\n"
        "  const T* K = keys + b * keys_strides[0] + kv_head_idx * keys_strides[1] + kv_seq_idx * keys_strides[2];\n"
        "  const T* V = values + b * values_strides[0] + kv_head_idx * values_strides[1] + kv_seq_idx * values_strides[2];\n"
        "  const bool* row = mask + (size_t)b * kL;\n",
    ),
    (
        "  T* O = out + (size_t)(q_seq_idx * H + head_idx) * D;\n",
        "  T* O = out + (size_t)(b * H + head_idx) * D;\n",
    ),
    (
        "  for (int i = kv_seq_idx; i < kL; i += BN) {\n",
        "  for (int i = kv_seq_idx; i < kL; i += BN) {\n"
        "    if (!row[i]) {\n      K += inner_k_stride;\n      V += inner_v_stride;\n      continue;\n    }\n",
    ),
)


def _edited(source: str) -> str:
    """``source`` with ``EDITS`` applied, each where it matches exactly once (else MLX's text moved: fail
    at import, not in a kernel)."""
    for old, new in EDITS:
        if source.count(old) != 1:
            raise RuntimeError(f"batch_attention: the one-pass kernel's text no longer holds {old.strip()!r}")
        source = source.replace(old, new)
    return source


SOURCE = _edited(sdpa_source.ONE_PASS)

HEAD_DIMS = (64, 96, 128, 256)
#: How far the kernel's output may be from MLX's own call at its first use, as a share of the largest
#: value magnitude: bf16 attention outputs differ by a few bf16 ulps (2^-8 relative) between kernels; a
#: key or a head taken wrong is off by the values' own size.
TOLERANCE = 2.0**-5

_kernel: list[Any] = []
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
    s = sdpa_rows.scale_array(scale)
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
