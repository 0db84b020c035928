"""``mlx-batchd serve --model FILE.gguf`` end to end on the real SmolLM2 GGUF: the first daemon
converts the file into the cache and answers a chat request; a second one reuses the folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients import Client
from tests.conftest import start_daemon

# The prefix cache off: its start-up check on this model is tested elsewhere, and would run here per cache.
ARGS = ("--context-length", "512", "--default-max-tokens", "24", "--max-batch", "4", "--prefix-cache-mb", "0")


def test_serve_gguf_converts_once_and_answers(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(cache))
    first = start_daemon(smollm2_gguf, tmp_path / "first", *ARGS)
    try:
        with Client(first.address, timeout=120) as client:
            health = client.health()
            result = client.generate(
                messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24
            )
    finally:
        assert first.stop() == 0, first.log()
    assert "converting SmolLM2-135M-Instruct.Q4_1.gguf" in first.log()
    assert "Paris" in result.text and result.finish_reason == "stop", result
    assert "SmolLM2-135M-Instruct" in str(health), health
    (folder,) = [p for p in (cache / "gguf").iterdir() if p.name != "by-stat"]
    stamp = (folder / "model.safetensors").stat().st_mtime_ns

    second = start_daemon(smollm2_gguf, tmp_path / "second", *ARGS)
    assert second.stop() == 0, second.log()
    assert "converting" not in second.log()
    assert [p for p in (cache / "gguf").iterdir() if p.name != "by-stat"] == [folder]
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
