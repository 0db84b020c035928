"""Where MLX CUDA keeps the kernels it compiles (``backend.configure_kernel_cache``)."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest

from workers.kernels import backend


def test_on_cuda_compiled_kernels_go_to_the_project_cache_per_mlx_version_and_architecture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(backend.KERNEL_CACHE_ENV, "")  # recorded, so the test's own setting is undone
    monkeypatch.delenv(backend.KERNEL_CACHE_ENV)
    folder = backend.configure_kernel_cache(tmp_path, cuda=True)
    info = backend.backend_fingerprint()
    assert folder is not None and folder.is_relative_to(tmp_path / "kernels")
    assert info["mlx"] == mx.__version__ and folder.parent.name == info["mlx"]
    assert backend.KERNEL_CACHE_ENV in os.environ
    assert Path(os.environ[backend.KERNEL_CACHE_ENV]) == folder


def test_the_operator_s_folder_wins_and_other_backends_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(backend.KERNEL_CACHE_ENV, str(tmp_path / "mine"))
    assert backend.configure_kernel_cache(tmp_path, cuda=True) == tmp_path / "mine"
    monkeypatch.delenv(backend.KERNEL_CACHE_ENV)
    assert backend.configure_kernel_cache(tmp_path, cuda=False) is None
    assert backend.KERNEL_CACHE_ENV not in os.environ
