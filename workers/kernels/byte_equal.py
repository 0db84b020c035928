"""Byte equality, the one test of exactness: a verify block is exact when its logits are the same
bytes as classic decode's (never ``allclose``), and widths are measured the same way."""

from __future__ import annotations

import mlx.core as mx


def bytes_equal(a: mx.array, b: mx.array) -> bool:
    """Byte equality of two arrays of the same dtype (never ``allclose``)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.all(bytes_view(a) == bytes_view(b)).item())


def bytes_view(a: mx.array) -> mx.array:
    """The array's raw bytes as unsigned integers, so NaNs and signed zeros compare exactly."""
    view = {2: mx.uint16, 4: mx.uint32, 8: mx.uint64, 1: mx.uint8}[a.dtype.size]
    return a.view(view)
