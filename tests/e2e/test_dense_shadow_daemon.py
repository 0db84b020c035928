"""``serve --dense-shadow on`` end to end: a real daemon on a tiny 4-bit model keeps the dequantized
shadow of its quantized projections (``workers.kernels.dense_shadow``), says so in its start-up banner,
serves lone and batched requests through the client, and reports the shadow's bytes in stats; the
same daemon without the option reports 0."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clients import Client
from tests.conftest import start_daemon
from workers.models.synthetic import llama_config, write_model

PROMPTS = ["import os\n", "def count_words(text):\n", "class Stack:\n"]


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-q4"
    return write_model(path, llama_config(hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, quant_bits=4), seed=7)


def _shadow_bytes(model: Path) -> int:
    from mlx_lm import load

    from workers.kernels import dense_shadow

    return dense_shadow.shadow_bytes(load(str(model))[0])


def _serve(model: Path, workdir: Path, *extra: str) -> tuple[list[str], int, str]:
    """Texts (one lone, then the prompts together), ``dense_shadow_bytes`` from stats, and the log."""
    daemon = start_daemon(model, workdir, "--max-tokens-cap", "64", *extra)
    try:
        with Client(daemon.address, timeout=120) as c:
            lone = c.generate(PROMPTS[0], max_tokens=12).text
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                batched = list(pool.map(lambda p: c.generate(p, max_tokens=12).text, PROMPTS))
            nbytes = c.stats()["engine"]["dense_shadow_bytes"]
    finally:
        assert daemon.stop() == 0, daemon.log()
    return [lone, *batched], nbytes, daemon.log()


def test_a_daemon_with_the_dense_shadow_serves_and_reports_its_bytes(q4_model: Path, tmp_path: Path) -> None:
    want = _shadow_bytes(q4_model)
    assert want > 0
    texts, nbytes, log = _serve(q4_model, tmp_path / "on", "--dense-shadow", "on")
    assert nbytes == want
    assert all(texts) and len(texts) == 1 + len(PROMPTS)
    assert f"dense shadow:   on, {want / 2**30:.2f} GiB (--dense-shadow on: asked for)" in log, log
    _, off_bytes, off_log = _serve(q4_model, tmp_path / "off")
    assert off_bytes == 0
    assert "dense shadow:   off (--dense-shadow off: not asked for)" in off_log, off_log
