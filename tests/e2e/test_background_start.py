"""A daemon started on an empty cache folder says ``ready`` and serves before its start-up work
(kernel plans, the prefix cache's check) is done; ``stats`` shows that work until it ends, and the log
has a line for each piece's end. The CPU's own policy does not calibrate: the CUDA policy, forced,
does (``MLX_BATCHD_FASTPATH=cuda``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from clients import Client
from tests.conftest import TEST_CONTEXT, start_daemon


def test_a_daemon_on_an_empty_cache_serves_while_its_plans_are_timed(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MLX_BATCHD_FASTPATH", "cuda")
    d = start_daemon(tiny_model, tmp_path / "daemon", "--context-length", str(TEST_CONTEXT), "--prefix-cache-mb", "16")
    try:
        with Client(d.address, timeout=120) as c:
            assert len(c.generate(tokens=[5, 6, 7], max_tokens=4).tokens) == 4
            first = c.stats()["engine"]
            assert set(first["start_up"]) == {"kernel plans", "prefix check"}
            deadline = time.monotonic() + 120
            engine = first
            while any(r["status"] != "done" for r in engine["start_up"].values()):
                assert time.monotonic() < deadline, engine["start_up"]
                time.sleep(0.05)  # polling: the daemon offers no completion event
                engine = c.stats()["engine"]
            assert engine["kernel_plans"] and engine["prefix_cache"]["serving"]
            assert len(c.generate(tokens=[5, 6, 7], max_tokens=4).tokens) == 4
    finally:
        assert d.stop() == 0, d.log()
    log = d.log()
    assert "start-up work kernel plans done in" in log and "start-up work prefix check done in" in log
    assert log.index("prefix check done") > log.index("kernel plans done")
