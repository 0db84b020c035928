"""Reading scalars out of MLX arrays with the types the rest of the code expects."""

from __future__ import annotations

from typing import cast

import mlx.core as mx


def as_int(a: mx.array) -> int:
    """A one-element array as ``int`` (evaluates it)."""
    return int(cast(int, a.item()))


def as_float(a: mx.array) -> float:
    """A one-element array as ``float`` (evaluates it)."""
    return float(cast(float, a.item()))
