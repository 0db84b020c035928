"""The distributed tests' models, shared by the in-process tests and the 2-rank runs."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny random float32 llamas: two seeds of one shape, and one whose 1 KV head cannot split in two."""
    from workers.synthetic import llama_config, write_model

    root = tmp_path_factory.mktemp("dist-models")

    def config(kv_heads: int) -> dict[str, Any]:
        return llama_config(hidden=128, layers=2, ffn=256, heads=4, kv_heads=kv_heads, dtype="float32")

    return {
        "a": str(write_model(root / "a", config(2), seed=7)),
        "b": str(write_model(root / "b", config(2), seed=8)),
        "one_kv_head": str(write_model(root / "kv1", config(1), seed=7)),
    }
