"""MLX CUDA's compiled kernels are kept in the project's cache folder, so they outlive the temporary
folder between starts, unless the operator chose the place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.engine.startup import check_environment


def test_compiled_kernels_go_to_the_project_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path))
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    check_environment()

    assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "ptx")


def test_an_operators_kernel_cache_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))
    check_environment()

    assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "mine")
