"""The prefix cache's defaults through real daemons: on without ``--prefix-cache-mb`` (a share of
``--kv-budget-mb`` when one is set, off with 0), its start-up check stored and read back by the next
start, what the daemon serves with in a few readable lines, and the start-up probe's progress."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from clients import Client
from scheduler.cli.serve import DEFAULT_PREFIX_CACHE_MB, PREFIX_CACHE_SHARE
from tests.conftest import start_daemon, wait_for_verdict, wait_started

CHECK_LINE = "prefix cache check: draw 1/"


def _cache(address: str) -> dict[str, Any]:
    """The prefix cache's stats once the daemon's start-up work (its check, where not stored) ended."""
    with Client(address, timeout=120) as c:
        return dict(wait_started(c)["prefix_cache"])


@pytest.fixture()
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of this test's own, so no other test's stored check is found."""
    path = tmp_path / "cache"
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(path))
    return path


def test_the_default_cache_serves_and_its_check_is_stored_for_the_next_start(
    tiny_model: Path, tmp_path: Path, own_cache: Path
) -> None:
    first = start_daemon(tiny_model, tmp_path / "first")
    try:
        cache = _cache(first.address)
        assert cache["max_bytes"] == int(DEFAULT_PREFIX_CACHE_MB * 2**20) and cache["serving"] is True
        assert cache["verdict"]["from_cache"] is False
    finally:
        assert first.stop() == 0, first.log()
    log = first.log()
    assert CHECK_LINE in log, log  # the check shows its progress
    assert len(list((own_cache / "prefix-checks").glob("*.json"))) == 1
    for what in ("model:", "quantization:", "context:", "drafter:", "prefix cache:"):
        assert f"serving with {what}" in log, log
    assert "serving with prefix cache:   up to 512 MiB, off until its check (between steps) passes" in log, log
    assert "prefix cache: serving (warm == cold" in log and "start-up work prefix check done in" in log, log

    # A KV budget: the default is a share of it, and the stored check serves without running again.
    second = start_daemon(tiny_model, tmp_path / "second", "--kv-budget-mb", "8")
    try:
        cache = _cache(second.address)
        assert cache["max_bytes"] == int(PREFIX_CACHE_SHARE * 8 * 2**20) and cache["serving"] is True
        assert cache["verdict"]["from_cache"] is True
    finally:
        assert second.stop() == 0, second.log()
    assert CHECK_LINE not in second.log() and "up to 2 MiB, serving (stored check)" in second.log(), second.log()


def test_zero_turns_it_off_and_the_start_up_probe_shows_its_progress(
    tiny_model: Path, tmp_path: Path, own_cache: Path
) -> None:
    d = start_daemon(tiny_model, tmp_path, "--prefix-cache-mb", "0", "--draft", "prompt-lookup", "-k", "2")
    try:
        assert _cache(d.address)["enabled"] is False
        with Client(d.address, timeout=120) as c:
            wait_for_verdict(c)
    finally:
        assert d.stop() == 0, d.log()
    log = d.log()
    assert CHECK_LINE not in log and not (own_cache / "prefix-checks").exists(), log
    assert "serving with prefix cache:   off" in log and "serving with drafter:        prompt-lookup, K = 2" in log
    assert ": draw 1, " in log and ": done after " in log, log  # a line per probe draw, then the verdict
