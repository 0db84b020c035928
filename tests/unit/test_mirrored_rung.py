"""The ``mirrored`` rung without a model: it pins no chain and attends per query, and which layers and
activations the project's kernel (``qmv_rows``) covers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.helpers.mirrored import _quantized
from workers.api import Level
from workers.kernels import qmv_launch, qmv_rows

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


def test_a_checked_groups_launch_arguments_are_worked_out_once_per_row_count_and_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel's launch arguments live on a checked group's ``Mats`` (by rows, outputs per warp,
    tiles ahead and dtype): the same call again reuses them, another row count or setting gets its
    own, and a plain list (a check's one-off call) keeps none. The kernel is a recording stand-in
    (it cannot run on a CPU)."""
    calls: list[dict[str, object]] = []

    def stand_in(count: int) -> object:
        def call(*, inputs: list[mx.array], **kwargs: object) -> list[mx.array]:
            calls.append({"inputs": len(inputs), **kwargs})
            return [mx.zeros((inputs[0].shape[0], 24), dtype=inputs[0].dtype)] * count

        return call

    monkeypatch.setattr(qmv_rows, "_kernel", stand_in)
    q = _quantized()
    found = qmv_rows.covered(q, mx.zeros((1, 256), dtype=mx.bfloat16))
    assert found is not None
    mats = qmv_rows.Mats([found[:3]])
    x5, x2 = mx.zeros((5, 256), dtype=mx.bfloat16), mx.zeros((2, 256), dtype=mx.bfloat16)
    qmv_rows._launch(x5, mats, 4, 64)
    qmv_rows._launch(x5, mats, 4, 64)
    assert len(mats.plans) == 1 and calls[0] == calls[1] and calls[0]["output_shapes"] == [(5, 24)]
    qmv_rows._launch(x2, mats, 4, 64)
    monkeypatch.setattr(qmv_launch, "PER_WARP", {5: 1})
    qmv_rows._launch(x5, mats, 4, 64)
    assert len(mats.plans) == 3
    assert ("R", 1) in calls[-1]["template"] and ("R", qmv_launch.OUTS_PER_WARP) in calls[0]["template"]
    # Warps per block are a setting of their own: the grid covers the same warps in smaller blocks.
    monkeypatch.setattr(qmv_launch, "BLOCK_WARPS", {5: 4})
    qmv_rows._launch(x5, mats, 4, 64)
    assert len(mats.plans) == 4 and calls[-1]["threadgroup"] == (128, 1, 1)
    assert calls[-1]["grid"] == (-(-24 // 1 // 4) * 128, 1, 1)  # 24 outputs, one a warp: 6 blocks of 4 warps
    plain = [found[:3]]
    qmv_rows._launch(x5, plain, 4, 64)
    assert not hasattr(plain, "plans") and calls[-1] == calls[-2]
