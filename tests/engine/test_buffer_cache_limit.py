"""The engine process caps MLX's buffer cache (``workers.engine.startup.buffer_cache_limit``): by default a
quarter of MLX's memory limit, or what ``mlx_cache_limit_mb`` says; the engine thread applies it
before it loads the model. MLX keeps one limit per process, so each test puts the old one back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from tests.helpers.engine_thread import EngineThreadRun
from workers.api import EngineSettings
from workers.engine.startup import CACHE_SHARE, buffer_cache_limit


@pytest.fixture
def restore_cache_limit() -> Iterator[None]:
    before = mx.set_cache_limit(mx.get_memory_limit())
    mx.set_cache_limit(before)
    yield
    mx.set_cache_limit(before)


def test_the_default_is_a_share_of_mlx_memory_limit() -> None:
    assert 0 < CACHE_SHARE < 1
    assert buffer_cache_limit(EngineSettings()) == int(CACHE_SHARE * mx.get_memory_limit())
    assert buffer_cache_limit(EngineSettings(mlx_cache_limit_bytes=0)) == 0
    assert buffer_cache_limit(EngineSettings(mlx_cache_limit_bytes=123 << 20)) == 123 << 20


@pytest.mark.parametrize("asked", [None, 7 << 20])
def test_the_engine_thread_applies_it(tiny_model: Path, restore_cache_limit: None, asked: int | None) -> None:
    mx.set_cache_limit(mx.get_memory_limit())  # MLX's own default, whatever ran before
    with EngineThreadRun(tiny_model, mlx_cache_limit_bytes=asked):
        applied = mx.set_cache_limit(mx.get_memory_limit())
    assert applied == buffer_cache_limit(EngineSettings(mlx_cache_limit_bytes=asked))
