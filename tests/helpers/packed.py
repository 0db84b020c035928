"""Random 4-bit weights as MLX packs them, for the CPU replays of the project's CUDA kernels."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def random_packed(n: int, k: int, gs: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """Random packed words (every nibble value) [n, k / 8] and bf16 scales/biases of both signs [n, k / gs]."""
    rng = np.random.default_rng(seed)
    q = mx.array(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32))
    s = mx.array(rng.normal(0.0, 0.01, size=(n, k // gs)).astype(np.float32)).astype(mx.bfloat16)
    b = mx.array(rng.normal(0.0, 0.05, size=(n, k // gs)).astype(np.float32)).astype(mx.bfloat16)
    return q, s, b
