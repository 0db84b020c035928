"""The ``mirrored`` rung without a model: it pins no chain and attends per query, and which layers and
activations the project's kernel (``qmv_rows``) covers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.helpers.mirrored import _quantized
from workers import qmv_rows
from workers.kernels import Level

pytestmark = pytest.mark.usefixtures("clean_kernel_state")


def test_mirrored_does_not_pin_the_chain_and_attends_per_query() -> None:
    assert Level.MIRRORED.per_query and not Level.MIRRORED.pins_chain and not Level.MIRRORED.calibrated


def test_the_kernel_covers_affine_4_and_8_bit_layers_with_half_activations_only() -> None:
    q = _quantized()
    x = mx.zeros((3, 256), dtype=mx.bfloat16)
    assert qmv_rows.covered(q, x) is not None
    assert qmv_rows.covered(q, x.astype(mx.float32)) is None  # scales are bf16: a dtype the kernel does not mix
    assert qmv_rows.covered(q, x.reshape(3, 1, 256)) is None
    assert qmv_rows.covered(nn.Linear(256, 24), x) is None
    q3 = nn.QuantizedLinear(256, 24, bits=3, group_size=64)
    q3.set_dtype(mx.bfloat16)
    assert qmv_rows.covered(q3, x) is None
