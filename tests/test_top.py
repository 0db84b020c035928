"""``mlx-batchd top``: one frame from a real daemon, and the rate math of ``render`` on snapshots."""

from __future__ import annotations

import io
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from clients import Client
from scheduler.cli import build_parser, top_view
from scheduler.cli.stats import format_stats
from scheduler.stats_types import EngineSnapshot, StatsReply, engine_of
from tests.conftest import start_daemon, wait_for_verdict
from workers.kernels import Level


def _text(renderable: Any) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def _row(frame: str, label: str) -> list[str]:
    """The cells of the table row whose first cell is ``label``."""
    for line in frame.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells and cells[0] == label:
            return cells
    raise AssertionError(f"no row {label!r} in:\n{frame}")


def test_top_once_against_a_daemon(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = start_daemon(tiny_model, tmp_path, "--draft", "prompt-lookup", "-k", "2", "--prefix-cache-mb", "16")
    try:
        with Client(daemon.address, timeout=120) as c:
            verdict = wait_for_verdict(c)
            result = c.generate(tokens=[5, 6, 7, 5, 6, 7], max_tokens=6)
            assert result.finish_reason in ("length", "stop")
            [pairing] = c.stats()["engine"]["verdicts"]
            shared = [(7 * i + 3) % 250 + 4 for i in range(40)]  # a prefix the cache serves the second time
            reasons = [result.finish_reason] + [
                c.generate(tokens=shared + tail, max_tokens=2).finish_reason for tail in ([11], [12])
            ]
            cache = c.stats()["engine"]["prefix_cache"]
            assert cache["serving"] and cache["hit_tokens"] >= 16, cache
        capsys.readouterr()
        args = build_parser().parse_args(["top", "--addr", daemon.address, "--once", "--timeout", "60"])
        assert args.func(args) == 0
        frame = capsys.readouterr().out
    finally:
        assert daemon.stop() == 0
    assert _row(frame, "requests completed")[1] == "3"
    assert _row(frame, "state")[1] == "serving"
    assert _row(frame, "hit rate")[1] == f"{cache['hit_rate'] * 100:.1f} %"
    assert _row(frame, "tokens from the cache")[1] == f"{cache['hit_tokens']} of {cache['lookup_tokens']}"
    assert _row(frame, "bytes")[1] == f"{cache['bytes'] / 2**20:.1f} / 16.0 MiB" and cache["bytes"] > 0
    assert _row(frame, "requests in flight")[1] == "0"
    row = _row(frame, pairing)
    assert row[1] == verdict["level"]
    assert row[2] == ("exact" if verdict["exact"] else "inexact")
    assert _row(frame, "local")[2] == "3"  # the default tenant's requests
    for reason in set(reasons):
        assert _row(frame, reason)[1] == str(reasons.count(reason))
    assert _row(frame, "drafter")[1].startswith("prompt-lookup k=2")
    # One frame, no previous snapshot: rates cannot be known yet.
    assert _row(frame, "tokens/s total")[1] == top_view.MISSING


@pytest.mark.parametrize(
    "command",
    [["top", "--once", "--timeout"], ["stats", "--timeout"], ["generate", "def f(x):", "--connect-timeout"]],
    ids=["top", "stats", "generate"],
)
def test_unreachable_daemon_is_one_line_and_exit_1(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No traceback and no endless wait: every command that needs a daemon says it is not there (a
    socket file nobody listens on; a missing file is refused before any wait, see test_cli_errors)."""
    sock = tmp_path / "nobody.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
    address = f"ipc://{sock}"
    args = build_parser().parse_args([*command, "0.5", "--addr", address])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert err == f"mlx-batchd {command[0]}: no reply from {address} within 0.5s (is the daemon running?)\n"


def stats_snapshot(
    uptime: float,
    generated: int,
    emitted: int,
    drafted: int,
    accepted: int,
    queries: int = 4,
    hits: int = 2,
    hit_tokens: int = 300,
    lookup_tokens: int = 1000,
) -> StatsReply:
    """A whole ``stats`` reply of a daemon with a drafter, a verdict and a serving prefix cache."""
    return {
        "uptime_s": uptime,
        "requests_in_flight": 1,
        "messages_received": 12,
        "messages_refused": 0,
        "messages_dropped": 0,
        "requests_completed": 3,
        "requests_waiting": 0,
        "kv_reserved_bytes": 0,
        "kv_budget_bytes": 0,
        "clients_paused": 0,
        "unsent_messages": 0,
        "clients_dropped": 0,
        "outcomes": {"local": {"length": 2, "cancelled": 1}},
        "tenants": {
            "local": {
                "weight": 1.0,
                "active": 1,
                "waiting": 2,
                "virtual_counter": 0.0,
                "served_prompt_tokens": 40,
                "served_generated_tokens": generated,
            }
        },
        "engine": {
            "submitted": 4,
            "finished": 3,
            "prompt_tokens": 40,
            "generated_tokens": generated,
            "decode_steps": 10,
            "decode_seconds": 0.25,
            "steps": 12,
            "step_seconds": 0.3,
            "step_errors": 0,
            "peak_batch_size": 4,
            "active_sequences": 1,
            "paused": 0,
            "batch_size": 1,
            "pin_scope": "scoped",
            "pins": {
                "pinned": [{"level": Level.WIDE, "purpose": "verify", "forwards": 7, "rows": 21, "seconds": 0.5}],
                "unrequested": [],
                "collateral_forwards": 0,
                "collateral_seconds": 0.0,
            },
            "verdicts": {
                "m+prompt-lookup k=3": {
                    "level": Level.WIDE,
                    "exact": True,
                    "reason": "ok",
                    "probe_seconds": 1.5,
                    "from_cache": False,
                }
            },
            "bursts": {
                "drafter": "prompt-lookup",
                "k": 3,
                "active": False,
                "bursts": 2,
                "rounds": 9,
                "drafted_tokens": drafted,
                "accepted_tokens": accepted,
                "emitted_tokens": emitted,
                "interrupted": 0,
                "declined": {"batch": 4},
                "audits": 2,
                "audit_failures": 0,
                "revoked": {},
                "speedup_estimate": None,
                "classic_step_s": None,
                "round_s": None,
            },
            "pin_tax": {},
            "prefix_cache": {
                "enabled": True,
                "serving": True,
                "max_bytes": 64 * 2**20,
                "bytes": 3 * 2**20 + 2**19,
                "entries": 5,
                "queries": queries,
                "hits": hits,
                "hit_tokens": hit_tokens,
                "lookup_tokens": lookup_tokens,
                "stored": 5,
                "evictions": 2,
                "too_large": 0,
                "past_window": 0,
                "hit_rate": hit_tokens / lookup_tokens,
                "allow_inexact": False,
                "verdict": {
                    "exact": True,
                    "reason": "every draw equal",
                    "draws": [],
                    "seconds": 0.1,
                    "window_only": False,
                },
            },
            "memory": {"active_bytes": 2**20, "cache_bytes": 0, "peak_bytes": 2**21},
        },
    }


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
    assert lines[4].startswith("bursts: prompt-lookup k=3, 9 rounds, acceptance 0.75")
    assert lines[5] == "verdict m+prompt-lookup k=3: wide (exact) - ok"
    assert lines[6] == "pins (scoped): wide/verify 7 forwards 0.50s; collateral 0 forwards, 0.00s"

    stats["engine"] = {}
    lines = format_stats(health, stats).splitlines()
    assert lines[2] == "engine: not ready" and not any(line.startswith(("bursts", "pins")) for line in lines)
