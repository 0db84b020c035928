"""A real daemon whose decode steps run each layer compiled around attention (``workers.kernels.compiled_layers``,
the CUDA policy's default, switched on here with ``MLX_BATCHD_COMPILED_LAYERS=1``) serves the demo
pair as one that does not: the same text byte for byte, a lone request through the MTP head's bursts
(the probe measured on the compiled chain) and requests batched together."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from clients import Client
from tests.conftest import start_daemon, wait_for_verdict

PROMPTS = ["import os\n", "def count_words(text):\n", "class Stack:\n"]


def serve(tmp_path: Path, compiled: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("MLX_BATCHD_COMPILED_LAYERS", compiled)
    daemon = start_daemon("demo", tmp_path / f"compiled-{compiled}", "--mtp", "demo")
    try:
        with Client(daemon.address, timeout=120) as c:
            verdict = wait_for_verdict(c)
            lone = c.generate(PROMPTS[0], max_tokens=96)
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                batched = list(pool.map(lambda p: c.generate(p, max_tokens=48).text, PROMPTS))
            engine = c.stats()["engine"]
    finally:
        assert daemon.stop() == 0, daemon.log()
    return {
        "texts": [lone.text, *batched],
        "verdict": verdict,
        "rounds": engine["bursts"]["rounds"],
        "peak": engine["peak_batch_size"],
        "compiled_layers": engine["compiled_layers"],
    }


def test_a_daemon_with_compiled_layers_serves_the_plain_daemons_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = serve(tmp_path, "0", monkeypatch)
    compiled = serve(tmp_path, "1", monkeypatch)
    assert plain["compiled_layers"] == 0 and compiled["compiled_layers"] > 0
    assert compiled["verdict"]["exact"] and not compiled["verdict"]["from_cache"]  # measured on its own chain
    assert compiled["rounds"] > 0 and compiled["peak"] > 1
    assert compiled["texts"] == plain["texts"]


def test_the_cli_probes_verdict_serves_a_daemon_that_compiles_the_same_chain(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mlx-batchd probe`` runs classic decode as serving does, so a daemon that compiles it reads the
    CLI's verdict from the store; one that does not measures its own."""
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MLX_BATCHD_COMPILED_LAYERS", "1")
    cmd = [sys.executable, "-m", "scheduler", "probe", "--model", str(tiny_model), "-k", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    found = {}
    for compiled in ("1", "0"):
        monkeypatch.setenv("MLX_BATCHD_COMPILED_LAYERS", compiled)
        daemon = start_daemon(tiny_model, tmp_path / f"daemon-{compiled}", "--probe-k", "2")
        try:
            with Client(daemon.address, timeout=120) as c:
                found[compiled] = wait_for_verdict(c)["from_cache"]
        finally:
            assert daemon.stop() == 0, daemon.log()
    assert found == {"1": True, "0": False}
