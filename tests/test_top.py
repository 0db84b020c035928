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
from tests.conftest import start_daemon, wait_for_verdict


def _text(renderable: Any) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(renderable)
    out = console.file.getvalue()
    assert isinstance(out, str)
    return out


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


def _snapshot(
    uptime: float,
    generated: int,
    emitted: int,
    drafted: int,
    accepted: int,
    queries: int = 4,
    hits: int = 2,
    hit_tokens: int = 300,
    lookup_tokens: int = 1000,
) -> dict[str, Any]:
    return {
        "uptime_s": uptime,
        "requests_in_flight": 1,
        "requests_waiting": 0,
        "requests_completed": 3,
        "messages_refused": 0,
        "outcomes": {"local": {"length": 2, "cancelled": 1}},
        "tenants": {
            "local": {
                "weight": 1.0,
                "active": 1,
                "waiting": 2,
                "served_prompt_tokens": 40,
                "served_generated_tokens": generated,
            }
        },
        "engine": {
            "generated_tokens": generated,
            "decode_steps": 10,
            "peak_batch_size": 4,
            "active_sequences": 1,
            "batch_size": 1,
            "pin_scope": "scoped",
            "pins": {
                "pinned": [{"level": "wide", "purpose": "verify", "forwards": 7, "rows": 21, "seconds": 0.5}],
                "collateral_forwards": 0,
                "collateral_seconds": 0.0,
            },
            "verdicts": {"m+prompt-lookup k=3": {"level": "wide", "exact": True, "reason": "ok", "probe_seconds": 1.5}},
            "bursts": {
                "drafter": "prompt-lookup",
                "k": 3,
                "rounds": 9,
                "drafted_tokens": drafted,
                "accepted_tokens": accepted,
                "emitted_tokens": emitted,
                "declined": {"batch": 4},
                "audits": 2,
                "audit_failures": 0,
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
                "hit_rate": hit_tokens / lookup_tokens,
                "evictions": 2,
                "verdict": {"exact": True, "reason": "every draw equal"},
            },
        },
    }


def test_render_rates_and_acceptance() -> None:
    before = _snapshot(uptime=10.0, generated=1000, emitted=100, drafted=100, accepted=50)
    after = _snapshot(uptime=12.0, generated=1600, emitted=500, drafted=400, accepted=300)
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
    restarted = _snapshot(uptime=1.0, generated=5, emitted=0, drafted=0, accepted=0)
    assert _row(_text(top_view.render(restarted, after, 1.0)), "tokens/s total")[1] == top_view.MISSING


def test_render_tolerates_a_loading_daemon() -> None:
    frame = _text(top_view.render({"uptime_s": 0.5, "engine": {}}, None, 0.0))
    assert _row(frame, "requests completed")[1] == top_view.MISSING
    assert _row(frame, "drafter")[1] == "none (bursts off)"
    assert _row(frame, "(none)")[4] == "engine not ready"


def test_render_prefix_cache_hit_rate_and_bytes() -> None:
    """Over the daemon's life (the daemon's ``hit_rate``) and over the interval (token deltas), and the
    bytes held against the bound; a declined cache says why, and a daemon without one says off."""
    before = _snapshot(10.0, 0, 0, 0, 0, queries=4, hits=2, hit_tokens=300, lookup_tokens=1000)
    after = _snapshot(12.0, 0, 0, 0, 0, queries=6, hits=4, hit_tokens=1200, lookup_tokens=2000)
    frame = _text(top_view.render(after, before, 2.0))
    assert _row(frame, "state")[1] == "serving"
    assert _row(frame, "hit rate")[1] == "60.0 %"  # 1200 / 2000
    assert _row(frame, "hit rate (interval)")[1] == "90.0 %"  # 900 / 1000 since the last poll
    assert _row(frame, "hits / queries")[1] == "4 / 6"
    assert _row(frame, "tokens from the cache")[1] == "1200 of 2000"
    assert _row(frame, "bytes")[1] == "3.5 / 64.0 MiB"
    assert _row(frame, "entries")[1] == "5" and _row(frame, "evictions")[1] == "2"
    assert _row(_text(top_view.render(after, None, 0.0)), "hit rate (interval)")[1] == top_view.MISSING

    declined = _snapshot(12.0, 0, 0, 0, 0)
    declined["engine"]["prefix_cache"] |= {"serving": False, "verdict": {"exact": False, "reason": "draw 3 differs"}}
    assert _row(_text(top_view.render(declined, None, 0.0)), "state")[1] == "declined (draw 3 differs)"
    off = _snapshot(12.0, 0, 0, 0, 0)
    off["engine"]["prefix_cache"] = {"enabled": False}
    assert _row(_text(top_view.render(off, None, 0.0)), "state")[1] == "off"
    assert _row(_text(top_view.render({"engine": {}}, None, 0.0)), "state")[1] == "off"
