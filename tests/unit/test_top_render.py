"""``mlx-batchd top``'s ``render`` and ``stats``'s summary on ``stats`` snapshots: the rate math and
every part of the reply, with no daemon."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from scheduler.cli import top_view
from scheduler.cli.stats import format_stats
from scheduler.stats_types import EngineSnapshot, StatsReply, engine_of
from tests.helpers.stats import _row, stats_snapshot, with_pin_tax


def _text(renderable: Any) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def _engine(stats: StatsReply) -> EngineSnapshot:
    engine = engine_of(stats)
    assert engine is not None
    return engine


def test_render_rates_and_acceptance() -> None:
    before = stats_snapshot(uptime=10.0, generated=1000, emitted=100, drafted=100, accepted=50)
    after = stats_snapshot(uptime=12.0, generated=1600, emitted=500, drafted=400, accepted=300)
    frame = _text(top_view.render(after, before, 2.0))
    assert _row(frame, "tokens/s total")[1] == "300.0"  # (1600 - 1000) / 2
    assert _row(frame, "tokens/s burst")[1] == "200.0"  # (500 - 100) / 2
    assert _row(frame, "tokens/s batched")[1] == "100.0"  # the rest
    assert _row(frame, "acceptance")[1] == "0.75"  # 300 / 400 over the daemon's life
    assert _row(frame, "acceptance (interval)")[1] == "0.83"  # 250 / 300 since the last poll
    assert _row(frame, "local")[1:5] == ["1.0", "3", "3", "2"]  # weight, requests, in flight, waiting
    assert _row(frame, "declined")[1] == "batch 4"
    assert _row(frame, "m+prompt-lookup k=3")[1:4] == ["wide", "exact", "1.50"]

    # A restart between polls (counters went back) gives no rate rather than a negative one.
    restarted = stats_snapshot(uptime=1.0, generated=5, emitted=0, drafted=0, accepted=0)
    assert _row(_text(top_view.render(restarted, after, 1.0)), "tokens/s total")[1] == top_view.MISSING


def test_render_tolerates_a_loading_daemon() -> None:
    frame = _text(top_view.render({"uptime_s": 0.5, "engine": {}}, None, 0.0))
    assert _row(frame, "requests completed")[1] == top_view.MISSING
    assert _row(frame, "drafter")[1] == "none (bursts off)"
    assert _row(frame, "(none)")[4] == "engine not ready"


def test_render_prefix_cache_hit_rate_and_bytes() -> None:
    """Over the daemon's life (the daemon's ``hit_rate``) and over the interval (token deltas), and the
    bytes held against the bound; a declined cache says why, and a daemon without one says off."""
    before = stats_snapshot(10.0, 0, 0, 0, 0, queries=4, hits=2, hit_tokens=300, lookup_tokens=1000)
    after = stats_snapshot(12.0, 0, 0, 0, 0, queries=6, hits=4, hit_tokens=1200, lookup_tokens=2000)
    frame = _text(top_view.render(after, before, 2.0))
    assert _row(frame, "state")[1] == "serving"
    assert _row(frame, "hit rate")[1] == "60.0 %"  # 1200 / 2000
    assert _row(frame, "hit rate (interval)")[1] == "90.0 %"  # 900 / 1000 since the last poll
    assert _row(frame, "hits / queries")[1] == "4 / 6"
    assert _row(frame, "tokens from the cache")[1] == "1200 of 2000"
    assert _row(frame, "bytes")[1] == "3.5 / 64.0 MiB"
    assert _row(frame, "entries")[1] == "5" and _row(frame, "evictions")[1] == "2"
    assert _row(_text(top_view.render(after, None, 0.0)), "hit rate (interval)")[1] == top_view.MISSING

    declined = stats_snapshot(12.0, 0, 0, 0, 0)
    cache = _engine(declined)["prefix_cache"]
    cache["serving"] = False
    cache["verdict"] = {"exact": False, "reason": "draw 3 differs", "draws": [], "seconds": 0.1, "window_only": False}
    assert _row(_text(top_view.render(declined, None, 0.0)), "state")[1] == "declined (draw 3 differs)"
    off = stats_snapshot(12.0, 0, 0, 0, 0)
    _engine(off)["prefix_cache"] = {"enabled": False}
    assert _row(_text(top_view.render(off, None, 0.0)), "state")[1] == "off"
    assert _row(_text(top_view.render({"engine": {}}, None, 0.0)), "state")[1] == "off"


def test_stats_summary_reads_the_whole_reply() -> None:
    """``mlx-batchd stats``'s summary: the engine's line, the tenant, the bursts, the verdict and the
    pin ledger come from their parts of the reply; a loading daemon's reply (an empty engine part)
    says the engine is not ready instead."""
    stats = stats_snapshot(uptime=12.0, generated=1600, emitted=500, drafted=400, accepted=300)
    health = {"status": "ready", "model": {"name": "m", "type": "llama", "context_length": 512}}
    lines = format_stats(health, stats).splitlines()
    assert lines[0] == "mlx-batchd ready: model m (llama, context 512), up 12s"
    assert lines[2].startswith("engine: 1 active, batch 1 (peak 4), 1600 tokens generated")
    assert lines[3].startswith("  tenant local: weight 1.0, 1 active, 2 waiting")
    assert lines[4].startswith("bursts: prompt-lookup k=3, 9 rounds (27.78 ms each), acceptance 0.75")
    assert lines[5] == "verdict m+prompt-lookup k=3: wide (exact) - ok"
    assert lines[6] == "pins (scoped): wide/verify 7 forwards 0.50s; collateral 0 forwards, 0.00s"

    stats["engine"] = {}
    lines = format_stats(health, stats).splitlines()
    assert lines[2] == "engine: not ready" and not any(line.startswith(("bursts", "pins")) for line in lines)


def test_the_pin_tax_reads_the_rows_at_the_level_a_pin_would_run_at() -> None:
    """Both views show the verdict's measured cost at the pin's level, by batch size, and the saving."""
    stats = with_pin_tax(stats_snapshot(uptime=12.0, generated=1600, emitted=500, drafted=400, accepted=300))
    health = {"status": "ready", "model": {"name": "m", "type": "llama", "context_length": 512}}
    assert (
        "pin tax at narrow (a batched step pinned / wide): B=1 1.250x, B=8 1.500x; scoping saved ~1.75s of "
        "batched decode so far"
    ) in format_stats(health, stats).splitlines()
    frame = " ".join(_text(top_view.render(stats, None, 0.0)).split())  # the caption wraps to the table
    assert "pin tax at narrow (pinned / wide): B=1 1.250x, B=8 1.500x; scoping saved ~1.75s" in frame
