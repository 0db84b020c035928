"""A daemon's seconds before ``Ready``, phase by phase, in its stats and its log: every phase the
start ran, in order, none negative, all within its spawn-to-ready time."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients import Client
from tests.conftest import TEST_CONTEXT, start_daemon


def test_a_daemons_ready_phases_cover_its_start_in_order_in_stats_and_log(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    d = start_daemon(tiny_model, tmp_path / "daemon", "--context-length", str(TEST_CONTEXT), "--prefix-cache-mb", "16")
    try:
        with Client(d.address, timeout=120) as c:
            phases = c.stats()["engine"]["ready_phases"]
    finally:
        assert d.stop() == 0, d.log()
    assert list(phases) == [
        "set-up",
        "model files",
        "weights",
        "widths",
        "load (other)",
        "dense shadow",
        "engine",
        "warm-up",
        "prefix cache",
    ]
    assert all(s >= 0 for s in phases.values()), phases
    assert phases["weights"] > 0 and phases["warm-up"] > 0, phases
    ready = d.process.ready_seconds
    assert ready is not None and sum(phases.values()) <= ready, (phases, ready)
    logged = [line for line in d.log().splitlines() if "ready in " in line]
    assert len(logged) == 1 and "weights " in logged[0] and "warm-up " in logged[0], logged
