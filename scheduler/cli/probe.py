"""``mlx-batchd probe``: measure, per kernel level, whether a verify block is byte-identical to
classic decode for a model and drafter, and print the verdict the daemon would serve with.

The set-up (caches, pairing fingerprint, draws, verdict store) is the engine's own
(``workers.exact.setup``), so a verdict memoised here is the one ``serve`` finds for the same pairing.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from scheduler.cli.errors import local_command
from scheduler.cli.options import Parser, add_probe_policy, int_list, positive_int, probe_policy


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``probe``."""
    p = sub.add_parser("probe", help="measure whether a verify block is byte-identical to classic decode, per level")
    p.add_argument("--model", default="demo")
    p.add_argument("--draft", default="none", help="the drafter of the pairing (part of the verdict's fingerprint)")
    p.add_argument(
        "-k",
        type=int_list(1),
        default=None,
        help="drafted tokens per round; a comma list probes several (2,3,4); default serve's: 7 for an MTP "
        "head (--draft mtp:NAME), else 4",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--localize", action="store_true", help="name the first layer/op that diverges")
    p.add_argument("--force", action="store_true", help="re-probe even when a memoised verdict exists")
    p.add_argument("--no-store", action="store_true", help="neither read nor write memoised verdicts")
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=32,
        help="serve's --max-batch: the kernel plans are timed for steps of up to that many sequences, as the "
        "daemon's are (part of the verdict's fingerprint)",
    )
    add_probe_policy(p)
    p.set_defaults(func=local_command("probe", run))


def run(args: argparse.Namespace) -> int:
    """Probe each K in turn: a table per K (or one JSON document with ``--json``), then the
    row-exact widths measured at load."""
    from tqdm import tqdm

    from workers.exact import drive
    from workers.exact.report import iter_table, ladder_line, narrowed_widths, pin_cost_line
    from workers.exact.setup import probe_setup
    from workers.kernels import compiled_layers, plan_units
    from workers.models.demo import cache_dir
    from workers.models.loading import load

    loaded = load(args.model)
    # The kernel plans serving runs with (kept per machine): wide's batched forwards run by them,
    # so they are part of the verdict's fingerprint and of what the probe measures.
    plan_units.calibrate(loaded.model, cache_dir() / "kernel-plans", max_batch=args.max_batch)
    # Classic decode as serving runs it (compiled where the policy compiles it): the same chain,
    # the same fingerprint, so the verdict stored here is the one a daemon reads.
    compiled_layers.install(loaded.model)
    from workers.api import default_k

    # Checked by the parser (int_list); by default the K serve probes this drafter at.
    ks = [int(k) for k in args.k.split(",")] if args.k else [default_k(args.draft.startswith("mtp:"))]
    setup = probe_setup(loaded, args.draft, store=not args.no_store)
    pairing = setup.pairing
    report: list[dict[str, Any]] = []
    for k in ks:
        with tqdm(desc=f"probe k={k}", unit="draw", file=sys.stderr, disable=args.json) as bar:
            verdict = drive(
                setup.steps(loaded.model, k, probe_policy(args), force=args.force),
                progress=lambda label: _tick(bar, label),
            )
        report.append({"k": k, "verdict": verdict.to_json()})
        if not args.json:
            print(
                f"\nk = {k} drafted tokens (verify block of {k + 1}), model {loaded.info.name}, "
                f"{pairing['backend']['device']} {pairing['backend']['device_name']}"
            )
            print("| level | result | first position | draw | seconds |")
            print("|---|---|---|---|---|")
            for row in iter_table(verdict):
                print("| " + " | ".join(row) + " |")
            cached = " (memoised)" if verdict.from_cache else ""
            print(f"ladder: {ladder_line(verdict)}")
            for path, (before, after) in narrowed_widths(verdict).items():
                print(f"calibration narrowed {path}: {before} -> {after} rows")
            print(
                f"verdict: {verdict.level or 'declined'} ({'exact' if verdict.exact else 'inexact'}) - "
                f"{verdict.reason}; probe {verdict.probe_seconds:.2f}s{cached}"
            )
            cost = pin_cost_line(verdict)
            if cost is not None:
                print(cost)
    widths = loaded.widths.widths
    if args.json:
        print(json.dumps({"model": loaded.info.name, "widths": widths, "probes": report}, indent=2))
    else:
        print(
            "\nrow-exact widths measured at load on random inputs (the verdicts' calibrated widths serve): "
            + ", ".join(f"{k}: {v}" for k, v in widths.items())
        )
    return 0


def _tick(bar: Any, label: str) -> None:
    """Advance the progress bar by one draw, showing which one finished (a forward inside a draw
    only shows)."""
    from workers.exact import within_draw

    bar.set_postfix_str(label)
    if not within_draw(label):
        bar.update()
