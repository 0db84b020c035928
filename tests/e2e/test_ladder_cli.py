"""``mlx-batchd probe`` as a real command: it shows the ladder and the rung that won."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workers.models.synthetic import PRESETS, write_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers x 256, bf16, tied head: the demo pair's shape class (6 x 256 bf16)."""
    return write_model(tmp_path_factory.mktemp("ladder") / "tiny-llama", PRESETS["tiny-llama"], seed=5)


pytestmark = pytest.mark.usefixtures("clean_kernel_state")


def test_cli_probe_shows_the_ladder_and_the_winning_rung(llama: Path, tmp_path: Path) -> None:
    env = {**os.environ, "MLX_BATCHD_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "scheduler", "probe", "--model", str(llama), "-k", "2", "--no-store"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert "| wide (won) | exact |" in run.stdout
    assert "ladder: wide: exact (won) -> narrow: not needed" in run.stdout
    # what a process-wide pin would cost batched decode, measured with the verdict, per rung and batch size
    (cost,) = [line for line in run.stdout.splitlines() if line.startswith("a process-wide pin would cost")]
    for rung in ("narrow", "per-query", "per-query-1"):
        assert re.search(rf"[:;] {rung} B=1 [\d.]+x, B=8 [\d.]+x, B=32 [\d.]+x, B=128 [\d.]+x(;|$)", cost), cost
