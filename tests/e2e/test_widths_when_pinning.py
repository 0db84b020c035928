"""A daemon measures its projections' row-exact widths only when a forward of it may run above
``wide`` (a drafter's verify, the probe): without one the measurement's forwards (on MLX CUDA, its
first compiles) would only delay ``Ready``. Seen from outside as the width file the measurement
writes in the daemon's cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import start_daemon
from tests.helpers.daemons import serve_once


@pytest.mark.parametrize(
    ("model", "extra", "files"),
    [("tiny", (), 0), ("tiny", ("--draft", "prompt-lookup"), 1), ("demo", ("--mtp", "demo"), 1)],
)
def test_a_daemon_measures_widths_only_with_a_drafter(
    tiny_model: Path, tmp_path: Path, model: str, extra: tuple[str, ...], files: int
) -> None:
    cache = tmp_path / "cache"
    daemon = start_daemon(
        tiny_model if model == "tiny" else model,
        tmp_path / "d",
        "--prefix-cache-mb",
        "0",
        *extra,
        env={"MLX_BATCHD_CACHE": str(cache)},
    )
    log = serve_once(daemon)
    assert len(list((cache / "widths").glob("*.json"))) == files, log
