"""Tests that need MLX's CUDA backend (``pytest -m gpu`` on the device); skipped elsewhere."""

from __future__ import annotations

import mlx.core as mx
import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs MLX CUDA (run on the device: pytest -m gpu)"))
