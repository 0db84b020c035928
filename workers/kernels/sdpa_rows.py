"""Decode's attention for several queries of one sequence in one launch (MLX CUDA).

Classic decode attends one query at a time with MLX CUDA's vector attention kernel: one pass over the
keys up to 1,024 of them, two passes beyond. Each warp of that kernel takes every 32nd key (every 256th
in the two-pass kernel, 32 blocks of 8 warps) in order, whatever the key count, and the warps' partial
sums are then reduced in a fixed order. A verify block's K + 1 queries attend to 1, 2, ... keys more
than the cached context, so each query reproduces its own decode step if it runs exactly that kernel
over exactly its own key count. MLX itself cannot give that in one call (it sends several queries to
cuDNN, whose reduction differs), so the exact verify called MLX once per query and layer: 160 fused
calls and their views per 5-token block of a 32-layer model, much of the block's graph building.

This module's kernels are MLX's vector kernels (MLX 0.32) with two changes: the grid's second axis runs
over the block's queries and each query's thread block sets its key count to the keys before it and
its own (the first ``keys - queries + 1 + q``); and queries, keys and values are read through their
strides, where they lie (the cache's view of its buffer: no contiguous copies). Inside a thread block
every arithmetic operation, its operands and its order are those of MLX's kernel for one query of
that key count. Whether the device reproduces
MLX's own call byte for byte is measured (``attention._measure``, at first use per shape); where it
does not, the per-query calls stay. Decode steps whose key count is a multiple of 256 may run cuDNN on
MLX CUDA (its rule for a cache's contiguous keys), so those queries attend alone (``ALONE_EVERY``).
The CUDA text is ``workers.kernels.sdpa_source``.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from workers.kernels import jit_cache, rowkernel, sdpa_source

log = logging.getLogger("mlx_batchd.attention")

#: Key counts above this take MLX's two-pass kernel (a group never spans it: ``attention.SPLIT``).
ONE_PASS_KEYS = 1024
#: A query whose decode step saw a multiple of this many keys attends alone (cuDNN may have run it).
ALONE_EVERY = 256
#: Head dimensions MLX's vector kernel takes.
HEAD_DIMS = (64, 96, 128)

_kernels: dict[str, Any] = {}
#: The scale as the kernels read it, one array per value (a model has one): not one made per call.
_scales: dict[float, mx.array] = {}


def _kernel(name: str) -> Any:
    kernel = _kernels.get(name)
    if kernel is None:
        inputs, outputs, source = {
            "one_pass": (["queries", "keys", "values", "scale"], ["out"], sdpa_source.ONE_PASS),
            "pass_1": (["queries", "keys", "values", "scale"], ["partials", "sums", "maxs"], sdpa_source.PASS_1),
            "pass_2": (["partials", "sums", "maxs"], ["out"], sdpa_source.PASS_2),
        }[name]
        kernel = _kernels[name] = jit_cache.cuda_kernel(
            name=f"mlx_batchd_sdpa_rows_{name}",
            input_names=inputs,
            output_names=outputs,
            source=source,
            header=sdpa_source.HEADER,
            ensure_row_contiguous=False,  # reads the cache's views where they are (strides): no copies
        )
    return kernel


def scale_array(scale: float) -> mx.array:
    """The attention scale as the project's attention kernels read it: one float32 array per value."""
    s = _scales.get(scale)
    if s is None:
        s = _scales[scale] = mx.array([scale], dtype=mx.float32)
    return s


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
    s = scale_array(scale)
    template = [("T", queries.dtype), ("D", dim)]
    if total <= ONE_PASS_KEYS:
        kernel = _kernel("one_pass")
        jit_cache.prime(kernel, [queries, keys, values, s], template, [queries.dtype])
        (out,) = kernel(
            inputs=[queries, keys, values, s],
            template=template,
            grid=(heads * 1024, n, 1),
            threadgroup=(1024, 1, 1),
            output_shapes=[(1, n, heads, dim)],
            output_dtypes=[queries.dtype],
        )
    else:
        first, second = _kernel("pass_1"), _kernel("pass_2")
        jit_cache.prime(first, [queries, keys, values, s], template, [mx.float32] * 3)
        partials, sums, maxs = first(
            inputs=[queries, keys, values, s],
            template=template,
            grid=(heads * 256, n, 32),
            threadgroup=(256, 1, 1),
            output_shapes=[(1, heads, n, 32, dim), (1, heads, n, 32), (1, heads, n, 32)],
            output_dtypes=[mx.float32] * 3,
        )
        jit_cache.prime(second, [partials, sums, maxs], template, [queries.dtype])
        (out,) = second(
            inputs=[partials, sums, maxs],
            template=template,
            grid=(heads * 1024, n, 1),
            threadgroup=(1024, 1, 1),
            output_shapes=[(1, n, heads, dim)],
            output_dtypes=[queries.dtype],
        )
    # Written as (1, n, H, D), as MLX writes its own output: the model's transpose back is free.
    return out.transpose(0, 2, 1, 3)
