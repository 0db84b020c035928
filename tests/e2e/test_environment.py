"""The daemon starts in the environment users have: next to sniffio and the newest dependencies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from clients import Client
from tests.conftest import start_daemon


def test_daemon_serves_with_sniffio_installed(tiny_model: Path, tmp_path: Path) -> None:
    # With sniffio importable, anyio's task API refuses to run outside a task; the front end must
    # never call it from a plain loop callback (it did, and the daemon never answered).
    assert importlib.util.find_spec("sniffio") is not None, "the test extras must bring sniffio"
    d = start_daemon(tiny_model, tmp_path / "d")
    try:
        with Client(d.address, timeout=60) as c:
            assert c.health()["status"] == "ready"
            assert c.generate(tokens=[1, 2, 3], max_tokens=4).finish_reason == "length"
    finally:
        assert d.stop() == 0, d.log()
