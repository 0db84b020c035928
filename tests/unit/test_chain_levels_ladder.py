"""The rungs that pin classic decode too (``padded``, ``rowwise``), without a model: where the CUDA
ladder tries them, and every level can be pinned from the command line."""

from __future__ import annotations

import pytest

from workers import kernels
from workers.api import Level
from workers.kernels import fastpath

pytestmark = pytest.mark.usefixtures("clean_kernel_state")


def test_the_cuda_ladder_tries_mirrored_rowwise_then_padded_right_after_wide_and_others_neither(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLX_BATCHD_ROWKERNEL", "reference")
    fastpath.set_active(fastpath.CUDA)
    try:
        assert kernels.ladder()[:4] == (Level.WIDE, Level.MIRRORED, Level.ROWWISE, Level.PADDED)
        monkeypatch.setenv("MLX_BATCHD_ROWKERNEL", "off")
        assert kernels.ladder()[:2] == (Level.WIDE, Level.PADDED) and Level.ROWWISE not in kernels.ladder()
        assert Level.MIRRORED not in kernels.ladder()
    finally:
        fastpath.set_active(fastpath.GENERIC)
    try:
        assert Level.PADDED not in kernels.ladder() and Level.ROWWISE not in kernels.ladder()
    finally:
        fastpath.set_active(None)


def test_every_level_can_be_pinned_from_the_command_line() -> None:
    from scheduler.cli import build_parser

    for level in Level:
        args = build_parser().parse_args(["probe", "--pin-level", level.value])
        assert args.pin_level == level.value
