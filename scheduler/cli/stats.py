"""``mlx-batchd stats``: print a running daemon's health and counters once, as a summary or as the
raw replies (``--json``). ``top`` polls the same reply and redraws it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from scheduler.cli.errors import daemon_command
from scheduler.cli.options import Parser, add_client_auth, positive_float
from scheduler.cli.session import open_client
from scheduler.stats_types import EngineSnapshot, StatsReply, engine_of, read_stats


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``stats``."""
    p = sub.add_parser("stats", help="print a running daemon's health and counters")
    p.add_argument("--addr", default=None)
    p.add_argument("--timeout", type=positive_float, default=10.0)
    p.add_argument("--json", action="store_true", help="the raw health and stats replies")
    add_client_auth(p)
    p.set_defaults(func=daemon_command("stats", run))


def run(args: argparse.Namespace) -> int:
    """Ask for health and stats and print them."""
    with open_client(args, timeout=args.timeout) as client:
        health, stats = client.health(), client.stats()
    if args.json:
        print(json.dumps({"health": health, "stats": stats}, indent=2))
    else:
        print(format_stats(health, read_stats(stats)))
    return 0


def format_stats(health: Mapping[str, Any], stats: StatsReply) -> str:
    """A human summary of the ``stats`` reply."""
    model = health.get("model") or {}
    lines = [
        f"mlx-batchd {health.get('status')}: model {model.get('name')} ({model.get('type')}, context "
        f"{model.get('context_length')}), up {stats['uptime_s']:.0f}s",
        f"requests: {stats['requests_in_flight']} in flight, {stats['requests_waiting']} waiting, "
        f"{stats['requests_completed']} completed, {stats['messages_refused']} refused",
    ]
    e = engine_of(stats)
    if e is None:
        lines.append("engine: not ready")
    else:
        lines.append(
            f"engine: {e['active_sequences']} active, batch {e['batch_size']} (peak {e['peak_batch_size']}), "
            f"{e['generated_tokens']} tokens generated, {e['decode_steps']} decode steps"
        )
    for name, t in stats["tenants"].items():
        lines.append(
            f"  tenant {name}: weight {t['weight']}, {t['active']} active, {t['waiting']} waiting, served "
            f"{t['served_prompt_tokens']} prompt + {t['served_generated_tokens']} generated tokens"
        )
    if e is not None:
        lines += _engine_lines(e)
    return "\n".join(lines)


def _engine_lines(e: EngineSnapshot) -> list[str]:
    """Bursts, verdicts, the pin tax and the pin ledger."""
    lines = []
    b = e["bursts"]
    if b["drafter"]:
        rate = b["accepted_tokens"] / b["drafted_tokens"] if b["drafted_tokens"] else 0.0
        per_round = f" ({1e3 * b['round_seconds'] / b['rounds']:.2f} ms each)" if b["rounds"] else ""
        lines.append(
            f"bursts: {b['drafter']} k={b['k']}, {b['rounds']} rounds{per_round}, acceptance {rate:.2f}, "
            f"declined {b['declined']}, audits {b['audits']} ({b['audit_failures']} failed)"
        )
    for name, v in e["verdicts"].items():
        if "level" in v:
            state = f"{v['level'] or 'declined'} ({'exact' if v['exact'] else 'inexact'}) - {v['reason']}"
        else:
            state = f"probing ({v['at']})"
        lines.append(f"verdict {name}: {state}")
    tax = e["pin_tax"]
    if tax:
        ratios = ", ".join(f"B={r['batch']} {r['ratio']:.3f}x" for r in tax["rows"] if r["level"] == tax["level"])
        lines.append(
            f"pin tax at {tax['level']} (a batched step pinned / wide): {ratios}; scoping saved "
            f"~{tax['estimated_seconds_saved_by_scoping']:.2f}s of batched decode so far"
        )
    p = e["pins"]
    lines.append(
        f"pins ({e['pin_scope']}): "
        + ", ".join(f"{r['level']}/{r['purpose']} {r['forwards']} forwards {r['seconds']:.2f}s" for r in p["pinned"])
        + f"; collateral {p['collateral_forwards']} forwards, {p['collateral_seconds']:.2f}s"
    )
    return lines
