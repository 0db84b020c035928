"""The B = 1 table: classic decode vs each drafter's bursts through the daemon, and their JSON,
Markdown and PNG (``b1_bursts.*``). An arm whose bursts did not run is reported as declined, with its
ratio and spread, never as a speedup."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from scheduler.bench.output import save_png, write_whole
from scheduler.bench.spreads import paired_ratio, ratio_spread, spread


def b1_status(verdict: dict[str, Any], rounds: int, declined: dict[str, int] | None = None) -> str:
    """``bursts`` only when the verdict let bursts run and at least one round did; else why not
    (with the daemon's declined-burst reasons counted over the arm's runs, when there were any)."""
    if verdict.get("level") is None:
        return "declined: verdict"
    if not rounds:
        why = ", ".join(f"{r} {n}" for r, n in sorted((declined or {}).items(), key=lambda kv: -kv[1]) if n > 0)
        return f"declined: no burst round ran{f' ({why})' if why else ''}"
    return "bursts"


def b1_rows(
    samples: dict[tuple[str, int], list[float]],
    counts: dict[str, dict[str, float]],
    verdicts: dict[str, dict[str, Any]],
    reference: float | None = None,
    gates: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """B = 1 through the daemon: classic (no drafter) vs each drafter's bursts, same prompts and repeats.

    ``vs_classic`` is the ratio of medians and ``vs_classic_spread`` its range (``ratio_spread``);
    ``paired`` the median of each repeat's own ratio and ``paired_spread`` their range (``paired_ratio``).
    ``speedup`` is that ratio only for an arm whose bursts ran; a declined arm (declined verdict,
    or no round ran) has ``speedup`` None, and ``alike`` says whether 1.0 is within its spread
    (an arm that decoded classically must read 1.00, else the arms were not measured alike).
    ``round_ms`` is the rounds' mean wall time and ``round_steps`` that in classic B = 1 steps (at
    classic's median rate): what a round costs, whatever the adaptive gate then decided.
    ``gates``: each arm's daemon's ``bursts`` stats, of which ``last_pause`` (what its adaptive gate
    measured when it last paused bursting: why an arm declined with "adaptive" did) is kept as
    ``gate_pause``, and ``ahead_round_s`` (median rounds built ahead and not, as its gate last timed
    them: which way ``--lookahead auto`` went), and ``k``, the drafted tokens a round it served with
    (its default depends on the drafter: ``workers.api.default_k``)."""
    base = samples[("daemon", 1)]
    classic = statistics.median(base)

    def of_limit(tok_s: float) -> float | None:
        return None if not reference else tok_s / reference

    rows: list[dict[str, Any]] = [
        {
            "drafter": "classic (no drafter)",
            "tok_s": classic,
            "tok_s_spread": spread(base),
            "vs_classic": 1.0,
            "vs_classic_spread": ratio_spread(base, base),
            "paired": None,
            "paired_spread": None,
            "speedup": None,
            "status": "classic",
            "alike": None,
            "rounds": None,
            "acceptance": None,
            "tokens_per_round": None,
            "round_ms": None,
            "round_steps": None,
            "verdict": "-",
            "of_limit": of_limit(classic),
            "gate_pause": None,
            "ahead_round_s": None,
            "k": None,
        }
    ]
    for arm, c in counts.items():
        xs = samples[(arm, 1)]
        rate = statistics.median(xs)
        v = verdicts.get(arm, {})
        declined = {k.removeprefix("declined:"): int(n) for k, n in c.items() if k.startswith("declined:")}
        rounds = int(c["rounds"])
        status = b1_status(v, rounds, declined)
        round_s = c.get("round_seconds", 0.0) / rounds if rounds else None
        lo, hi = ratio_spread(xs, base)
        pair = paired_ratio(xs, base)
        rows.append(
            {
                "drafter": arm.removeprefix("bursts:"),
                "tok_s": rate,
                "tok_s_spread": spread(xs),
                "vs_classic": rate / classic,
                "vs_classic_spread": [lo, hi],
                "paired": None if pair is None else pair[0],
                "paired_spread": None if pair is None else pair[1],
                "speedup": rate / classic if status == "bursts" else None,
                "status": status,
                "alike": None if status == "bursts" else lo <= 1.0 <= hi,
                "rounds": rounds,
                "acceptance": c["accepted_tokens"] / c["drafted_tokens"] if c["drafted_tokens"] else None,
                "tokens_per_round": c["emitted_tokens"] / rounds if rounds else None,
                "round_ms": None if round_s is None else 1e3 * round_s,
                "round_steps": None if round_s is None else round_s * classic,
                "verdict": f"{v.get('level') or 'declined'}{'' if v.get('exact', False) else ' (inexact)'}",
                "of_limit": of_limit(rate),
                "gate_pause": (gates or {}).get(arm, {}).get("last_pause"),
                "ahead_round_s": (gates or {}).get(arm, {}).get("ahead_round_s"),
                "k": (gates or {}).get(arm, {}).get("k"),
            }
        )
    return rows


def _label(r: dict[str, Any]) -> str:
    """An arm's name, with the drafted tokens a round it served with where its daemon said."""
    return r["drafter"] if r.get("k") is None else f"{r['drafter']} (K = {r['k']})"


def _vs_classic_cell(r: dict[str, Any]) -> str:
    """A speedup only where bursts ran; a declined arm's ratio is labelled as such."""
    if r["status"] == "classic":
        return "1.000 (reference)"
    if r["status"] == "bursts":
        return f"{r['speedup']:.3f}x"
    return f"{r['status']} (ratio {r['vs_classic']:.3f})"


def _round_cell(r: dict[str, Any]) -> str:
    if r.get("round_ms") is None:
        return "-"
    return f"{r['round_ms']:.2f} ({r['round_steps']:.2f})"


def _paired_cell(r: dict[str, Any]) -> str:
    if r.get("paired") is None:
        return "-"
    lo, hi = r["paired_spread"]
    return f"{r['paired']:.3f} ({lo:.3f}-{hi:.3f})"


def b1_markdown(rows: list[dict[str, Any]], reference_line: str | None = None) -> str:
    """The B = 1 table: every arm's median and spread, its ratio to classic and that ratio's spread."""

    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    roof = any(r["of_limit"] is not None for r in rows)
    head = (
        "| drafter | tok/s | spread (min-max) | vs classic | spread of the ratio | paired by repeat (min-max) | rounds "
        "| acceptance | tokens/round | ms / round (classic steps) | verdict |"
    )
    rule = "|---|---|---|---|---|---|---|---|---|---|---|"
    if roof:
        head += " tok/s / physical limit |"
        rule += "---|"
    lines = [head, rule]
    for r in rows:
        lo, hi = r["tok_s_spread"]
        rlo, rhi = r["vs_classic_spread"]
        line = (
            f"| {_label(r)} | {r['tok_s']:.1f} | {lo:.1f}-{hi:.1f} | {_vs_classic_cell(r)} | {rlo:.3f}-{rhi:.3f} "
            f"| {_paired_cell(r)} | {cell(r['rounds'], 'd')} | {cell(r['acceptance'], '.3f')} | {cell(r['tokens_per_round'], '.2f')} "
            f"| {_round_cell(r)} | {r['verdict']} |"
        )
        if roof:
            line += f" {cell(r['of_limit'], '.3f')} |"
        lines.append(line)
    notes = [
        f"warning: {r['drafter']} decoded classically ({r['status']}) yet reads {r['vs_classic']:.3f} "
        f"({rlo:.3f}-{rhi:.3f}) of classic: these arms were not measured alike"
        for r in rows
        for rlo, rhi in [r["vs_classic_spread"]]
        if r["alike"] is False
    ]
    notes += [
        f"{r['drafter']}: the daemon's adaptive gate last paused bursting at {g['speedup']:.3f}x its classic "
        f"steps ({g['rounds']:.0f} rounds: {g['tokens_per_round']:.2f} tokens a round in {1e3 * g['round_s']:.2f} ms "
        f"against classic steps of {1e3 * g['classic_step_s']:.2f} ms, medians)"
        for r in rows
        if (g := r.get("gate_pause"))
    ]
    notes += [
        f"{r['drafter']}: rounds built ahead took {1e3 * a['on']:.2f} ms, not built ahead {1e3 * a['off']:.2f} ms "
        "(medians, as its gate last timed them)"
        for r in rows
        if (a := r.get("ahead_round_s")) and a.get("on") is not None and a.get("off") is not None
    ]
    if reference_line:
        notes.append(f"{reference_line} (classic decode; a burst round reads the weights once for several tokens)")
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes)


def write_b1(
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    out: Path,
    reference_line: str | None = None,
    runs: list[dict[str, Any]] | None = None,
) -> str:
    """B = 1 classic vs bursts: JSON, Markdown, PNG; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    write_whole(
        out / "b1_bursts.json",
        json.dumps({"meta": meta, "reference": reference_line, "rows": rows, "runs": runs or []}, indent=2),
    )
    md = b1_markdown(rows, reference_line)
    if meta.get("repeats_done"):
        md = f"partial: {meta['repeats_done']} of {meta.get('repeats', '?')} repeats so far\n\n{md}"
    write_whole(out / "b1_bursts.md", md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 0.6 * len(rows) + 1.5))
    tok_s = [r["tok_s"] for r in rows]
    errors = [
        [t - r["tok_s_spread"][0] for t, r in zip(tok_s, rows)],
        [r["tok_s_spread"][1] - t for t, r in zip(tok_s, rows)],
    ]
    ax.barh([_label(r) for r in rows], tok_s, xerr=errors, capsize=4)
    ax.set(
        xlabel="generated tokens / s at B = 1 (daemon, client over ipc; bars: median, whiskers: min-max)",
        title=f"{meta['model']} on {meta['device']}",
    )
    ax.invert_yaxis()
    save_png(fig, out / "b1_bursts.png")
    return md
