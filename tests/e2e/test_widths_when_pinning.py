"""A daemon measures its projections' row-exact widths only when a forward of it may run above
``wide`` (a drafter's verify, the probe): without one the measurement's forwards (on MLX CUDA, its
first compiles) would only delay ``Ready``. Seen from outside as the width file the measurement
writes in the daemon's cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients.sync import Client
from scheduler.spawn import DaemonProcess


@pytest.mark.parametrize(
    ("model", "extra", "files"),
    [("tiny", (), 0), ("tiny", ("--draft", "prompt-lookup"), 1), ("demo", ("--mtp", "demo"), 1)],
)
def test_a_daemon_measures_widths_only_with_a_drafter(
    tiny_model: Path, tmp_path: Path, model: str, extra: tuple[str, ...], files: int
) -> None:
    cache, log = tmp_path / "cache", tmp_path / "daemon.log"
    proc = DaemonProcess(
        tiny_model if model == "tiny" else model,
        f"ipc://{tmp_path / 'd.sock'}",
        "--prefix-cache-mb",
        "0",
        *extra,
        log=log.open("w"),
        env={"MLX_BATCHD_CACHE": str(cache)},
    )
    try:
        proc.wait_ready(timeout=120)
        with Client(proc.address, timeout=120) as client:
            result = client.generate(tokens=[1, 2, 3], max_tokens=4)
        assert len(result.tokens) == 4, log.read_text()
    finally:
        code = proc.stop()
    assert code == 0, log.read_text()
    assert len(list((cache / "widths").glob("*.json"))) == files, log.read_text()
