"""The start-up probe runs inside the daemon, in the background, and its verdict is in stats."""

from __future__ import annotations

from pathlib import Path

from clients import Client
from tests.conftest import start_daemon, wait_for_verdict
from tests.reference import greedy_reference


def test_startup_probe_verdict_in_stats_and_memoised(tiny_model: Path, tmp_path: Path) -> None:
    daemon = start_daemon(tiny_model, tmp_path / "a", "--probe-k", "2")
    try:
        with Client(daemon.address, timeout=120) as c:
            # Serving does not wait for the probe: a request sent while it runs (about a second here)
            # is answered, exact, before it is done; the probe yields to it between draws.
            assert _probing(c)
            result = c.generate(tokens=[5, 6, 7], max_tokens=10)
            assert _probing(c)
            assert result.tokens == greedy_reference(tiny_model, [5, 6, 7], 10)[0]
            verdict = wait_for_verdict(c)
            assert (verdict["level"], verdict["exact"], verdict["from_cache"]) == ("wide", True, False)
            pins = c.stats()["engine"]["pins"]
            assert pins["collateral_forwards"] == 0
            assert any(r["purpose"] == "probe" for r in pins["pinned"])
    finally:
        assert daemon.stop() == 0
    again = start_daemon(tiny_model, tmp_path / "b", "--probe-k", "2")
    try:
        with Client(again.address, timeout=120) as c:
            assert wait_for_verdict(c)["from_cache"] is True
    finally:
        assert again.stop() == 0


def _probing(c: Client) -> bool:
    """Whether the start-up probe is still running (its pairing shows ``probing``, no level yet)."""
    return any(v.get("status") == "probing" for v in c.stats()["engine"]["verdicts"].values())
