"""A quantized layer of the shape the ``mirrored`` rung's tests use, and a stand-in for its kernel's launch."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn


def _quantized(dtype: mx.Dtype = mx.bfloat16) -> nn.QuantizedLinear:
    mx.random.seed(5)
    q = nn.QuantizedLinear(256, 24, bits=4, group_size=64)
    q.set_dtype(dtype)
    return q


Launch = Callable[[mx.array, list[tuple[mx.array, ...]], int, int], list[mx.array]]


def one_row_launch(record: Callable[[mx.array, list[tuple[mx.array, ...]]], None]) -> Launch:
    """Stand-in for the mirrored kernel's CUDA launch (it cannot run on a CPU): MLX's own one-row
    call per row and matrix, after ``record(rows, matrices)`` notes the launch."""

    def launch(x: mx.array, mats: list[tuple[mx.array, ...]], bits: int, gs: int) -> list[mx.array]:
        record(x, mats)
        return [
            mx.concatenate([mx.quantized_matmul(x[i : i + 1], w, s, b, True, gs, bits) for i in range(x.shape[0])])
            for w, s, b in mats
        ]

    return launch
