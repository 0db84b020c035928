"""``mlx-batchd stats``: print a running daemon's health and counters once, as a summary or as the
raw replies (``--json``). ``top`` polls the same reply and redraws it."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from scheduler.cli.errors import daemon_command
from scheduler.cli.options import Parser, add_client_auth, non_negative_float, positive_float
from scheduler.cli.session import open_client


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``stats``."""
    p = sub.add_parser("stats", help="print a running daemon's health and counters")
    p.add_argument("--addr", default=None)
    p.add_argument("--timeout", type=positive_float, default=10.0)
    p.add_argument("--json", action="store_true", help="the raw health and stats replies")
    p.add_argument("--measure-tax", action="store_true", help="time a batched step pinned vs wide first")
    p.add_argument("--tax-wait", type=non_negative_float, default=2.0, help="seconds to let that measurement run")
    add_client_auth(p)
    p.set_defaults(func=daemon_command("stats", run))


def run(args: argparse.Namespace) -> int:
    """Ask for health and stats (after a pin-tax measurement with ``--measure-tax``) and print them."""
    with open_client(args, timeout=args.timeout) as client:
        if args.measure_tax:
            client.stats(measure_tax=True)
            time.sleep(args.tax_wait)
        health, stats = client.health(), client.stats()
    if args.json:
        print(json.dumps({"health": health, "stats": stats}, indent=2))
    else:
        print(format_stats(health, stats))
    return 0


def format_stats(health: dict[str, Any], stats: dict[str, Any]) -> str:
    """A human summary of the ``stats`` reply."""
    e = stats.get("engine", {})
    b = e.get("bursts", {})
    p = e.get("pins", {})
    model = health.get("model") or {}
    lines = [
        f"mlx-batchd {health.get('status')}: model {model.get('name')} ({model.get('type')}, context "
        f"{model.get('context_length')}), up {stats.get('uptime_s', 0):.0f}s",
        f"requests: {stats.get('requests_in_flight', 0)} in flight, {stats.get('requests_waiting', 0)} waiting, "
        f"{stats.get('requests_completed', 0)} completed, {stats.get('messages_refused', 0)} refused",
        f"engine: {e.get('active_sequences', 0)} active, batch {e.get('batch_size', 0)} (peak {e.get('peak_batch_size', 0)}), "
        f"{e.get('generated_tokens', 0)} tokens generated, {e.get('decode_steps', 0)} decode steps",
    ]
    for name, t in stats.get("tenants", {}).items():
        lines.append(
            f"  tenant {name}: weight {t['weight']}, {t['active']} active, {t['waiting']} waiting, served "
            f"{t['served_prompt_tokens']} prompt + {t['served_generated_tokens']} generated tokens"
        )
    if b.get("drafter"):
        rate = b["accepted_tokens"] / b["drafted_tokens"] if b.get("drafted_tokens") else 0.0
        lines.append(
            f"bursts: {b['drafter']} k={b['k']}, {b['rounds']} rounds, acceptance {rate:.2f}, "
            f"declined {b.get('declined') or {}}, audits {b['audits']} ({b['audit_failures']} failed)"
        )
    for name, v in e.get("verdicts", {}).items():
        lines.append(
            f"verdict {name}: "
            + (
                f"{v['level'] or 'declined'} ({'exact' if v['exact'] else 'inexact'}) - {v['reason']}"
                if "level" in v
                else f"probing ({v.get('at')})"
            )
        )
    tax = e.get("pin_tax") or {}
    if tax:
        lines.append(
            f"pin tax: batch {tax['batch']} at {tax['level']}: {tax['ratio']:.3f}x a wide step; scoping saved "
            f"~{tax['estimated_seconds_saved_by_scoping']:.2f}s of batched decode so far"
        )
    lines.append(
        f"pins ({e.get('pin_scope')}): "
        + ", ".join(
            f"{r['level']}/{r['purpose']} {r['forwards']} forwards {r['seconds']:.2f}s" for r in p.get("pinned", [])
        )
        + f"; collateral {p.get('collateral_forwards', 0)} forwards, {p.get('collateral_seconds', 0.0):.2f}s"
    )
    return "\n".join(lines)
