"""A quantized layer of the shape the ``mirrored`` rung's tests use."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def _quantized(dtype: mx.Dtype = mx.bfloat16) -> nn.QuantizedLinear:
    mx.random.seed(5)
    q = nn.QuantizedLinear(256, 24, bits=4, group_size=64)
    q.set_dtype(dtype)
    return q
