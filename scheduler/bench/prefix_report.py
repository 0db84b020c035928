"""The prefix cache scenario's tables: cold / warm TTFT, a chat's prefill with and without the cache,
throughput with no hit, each against its target; JSON, Markdown and PNG (``prefix_cache.*``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from scheduler.bench.output import save_png, write_whole
from scheduler.bench.spreads import ratio_spread, spread, with_spread

#: Issue 17's targets: cold / warm TTFT at least, chat prefill computed / cache-less at most,
#: throughput with the cache on and no hit / without the cache at least.
PREFIX_TARGETS = {"ttft_ratio": 5.0, "chat_fraction": 0.15, "throughput_ratio": 0.98}


def _ratio_cell(value: float, lohi: list[float], suffix: str = "") -> str:
    return f"{value:.3f}{suffix} ({lohi[0]:.3f}-{lohi[1]:.3f}{suffix})"


def prefix_ttft_rows(requests: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Cold (the first request of each new prefix) and warm (the later ones, new suffixes) TTFT:
    medians, spreads, their ratio with the range the samples allow, hit tokens."""
    cold = [r["ttft_s"] for r in requests if r["kind"] == "cold"]
    warm = [r["ttft_s"] for r in requests if r["kind"] == "warm"]
    if not cold or not warm:
        return None
    ratio = statistics.median(cold) / statistics.median(warm)
    return {
        "cold_ms": statistics.median(cold) * 1e3,
        "cold_spread_ms": [x * 1e3 for x in spread(cold)],
        "cold_requests": len(cold),
        "warm_ms": statistics.median(warm) * 1e3,
        "warm_spread_ms": [x * 1e3 for x in spread(warm)],
        "warm_requests": len(warm),
        "cold_over_warm": ratio,
        "cold_over_warm_spread": ratio_spread(cold, warm),
        "cold_hit_tokens": [r["hit_tokens"] for r in requests if r["kind"] == "cold"],
        "warm_hit_tokens": [r["hit_tokens"] for r in requests if r["kind"] == "warm"],
        "cold_daemon_ms": statistics.median(r["daemon_ttft_s"] or 0.0 for r in requests if r["kind"] == "cold") * 1e3,
        "warm_daemon_ms": statistics.median(r["daemon_ttft_s"] or 0.0 for r in requests if r["kind"] == "warm") * 1e3,
    }


def prefix_chat_rows(chats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per conversation: prompt tokens sent (every one a cache-less daemon prefills), what the
    cache-less daemon prefilled and what the cache daemon prefilled, the fraction, and whether the
    two daemons answered alike (else the two conversations differ after the first differing answer)."""
    rows = []
    for i, c in enumerate(chats):
        with_cache, without = c["cache"], c["no_cache"]
        same = [t["answer"] for t in with_cache["turns"]] == [t["answer"] for t in without["turns"]]
        rows.append(
            {
                "conversation": i + 1,
                "turns": len(with_cache["turns"]),
                "prompt_tokens": with_cache["prompt_tokens"],
                "no_cache_computed": without["computed_tokens"],
                "cache_computed": with_cache["computed_tokens"],
                "hit_tokens": with_cache["hit_tokens"],
                "fraction": with_cache["computed_tokens"] / with_cache["prompt_tokens"],
                "answers_identical": same,
                "cache_seconds": with_cache["seconds"],
                "no_cache_seconds": without["seconds"],
            }
        )
    return rows


def prefix_throughput_row(
    samples: dict[str, list[float]], batch: int, hits: dict[str, int], runs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Cache on (no hit) over no cache at ``batch``: medians, spreads, the ratio and its range, and per
    arm the median seconds of a run spent outside the engine's steps (where ``runs`` carry them)."""
    on, off = samples["cache"], samples["no_cache"]
    outside = {
        arm: statistics.median(r["seconds"] - r["steps"]["step_seconds"] for r in runs or [] if r["arm"] == arm)
        for arm in samples
        if any(r["arm"] == arm and "steps" in r for r in runs or [])
    }
    return {
        "outside_steps_s": outside,
        "batch": batch,
        "no_cache_tok_s": statistics.median(off),
        "no_cache_spread": spread(off),
        "cache_tok_s": statistics.median(on),
        "cache_spread": spread(on),
        "ratio": statistics.median(on) / statistics.median(off),
        "ratio_spread": ratio_spread(on, off),
        **hits,
    }


def _outside_line(outside: dict[str, float]) -> list[str]:
    if set(outside) != {"cache", "no_cache"}:
        return []
    return [
        f"A run's wall time outside the engine's steps (median): no cache {outside['no_cache']:.3f} s, "
        f"cache on {outside['cache']:.3f} s."
    ]


def _target(met: bool) -> str:
    return "met" if met else "not met"


def prefix_markdown(result: dict[str, Any]) -> str:
    """The prefix scenario's tables, for the parts finished so far."""
    meta = result["meta"]
    parts = []
    cache = meta.get("prefix_cache") or {}
    if not cache.get("serving", True):
        parts.append(
            f"warning: the cache daemon's prefix cache is not serving ({(cache.get('verdict') or {}).get('reason')}): "
            "every figure below is of a daemon without reuse"
        )
    elif meta.get("allow_inexact") and not (cache.get("verdict") or {}).get("exact", True):
        parts.append(
            "note: the cache daemon reuses under --allow-inexact: its start-up check found warm prefill not "
            f"byte-identical to cold ({(cache.get('verdict') or {}).get('reason')}), so warm outputs may differ"
        )
    t = result.get("ttft")
    if t:
        target = PREFIX_TARGETS["ttft_ratio"]
        parts.append(
            "\n".join(
                [
                    f"TTFT, a {meta['prefix_tokens']}-token shared prefix + {meta['suffix_tokens']}-token suffixes "
                    f"(client side, submit to first token; {t['cold_requests']} prefixes, {meta['warm_requests']} warm "
                    "requests each):",
                    "",
                    "| request | requests | TTFT median (ms) | min-max (ms) | daemon's ttft_s median (ms) | tokens from the cache |",
                    "|---|---|---|---|---|---|",
                    f"| cold (first of a new prefix) | {t['cold_requests']} | {t['cold_ms']:.1f} | "
                    f"{t['cold_spread_ms'][0]:.1f}-{t['cold_spread_ms'][1]:.1f} | {t['cold_daemon_ms']:.1f} | "
                    f"{min(t['cold_hit_tokens'])}-{max(t['cold_hit_tokens'])} |",
                    f"| warm (same prefix, new suffix) | {t['warm_requests']} | {t['warm_ms']:.1f} | "
                    f"{t['warm_spread_ms'][0]:.1f}-{t['warm_spread_ms'][1]:.1f} | {t['warm_daemon_ms']:.1f} | "
                    f"{min(t['warm_hit_tokens'])}-{max(t['warm_hit_tokens'])} |",
                    f"| cold / warm | | {t['cold_over_warm']:.2f}x | "
                    f"{t['cold_over_warm_spread'][0]:.2f}-{t['cold_over_warm_spread'][1]:.2f}x | | |",
                    "",
                    f"cold / warm: ratio of the medians (the range the samples allow); target >= {target:g}x: "
                    f"{_target(t['cold_over_warm'] >= target)}.",
                ]
            )
        )
    chat = result.get("chat_rows")
    if chat:
        target = PREFIX_TARGETS["chat_fraction"]
        lines = [
            f"A {meta['chat_turns']}-turn chat replayed through the client ({meta['chat_system_tokens']}-token first "
            f"message, {meta['chat_user_tokens']}-token user messages, answers of up to {meta['chat_answer_tokens']} "
            "greedy tokens; every turn sends the whole conversation), prefill tokens from each daemon's `stats`:",
            "",
            "| conversation | prompt tokens sent | prefilled, no cache | prefilled, cache | from the cache | "
            "prefilled / cache-less | answers identical | seconds, cache / no cache |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in chat:
            lines.append(
                f"| {r['conversation']} | {r['prompt_tokens']} | {r['no_cache_computed']} | {r['cache_computed']} | "
                f"{r['hit_tokens']} | {r['fraction'] * 100:.1f} % | {'yes' if r['answers_identical'] else 'no'} | "
                f"{r['cache_seconds']:.2f} / {r['no_cache_seconds']:.2f} |"
            )
        fractions = [r["fraction"] for r in chat]
        mid = statistics.median(fractions)
        lines += [
            "",
            f"prefilled / cache-less: median {mid * 100:.1f} % ({min(fractions) * 100:.1f}-{max(fractions) * 100:.1f} %) "
            f"over {len(chat)} conversation(s); target <= {target * 100:g} %: {_target(max(fractions) <= target)}.",
        ]
        parts.append("\n".join(lines))
    row = result.get("throughput")
    if row:
        target = PREFIX_TARGETS["throughput_ratio"]
        lo, hi = row["ratio_spread"]
        parts.append(
            "\n".join(
                [
                    f"Throughput at B = {row['batch']}, distinct random {meta['prompt_tokens']}-token prompts, "
                    f"{meta['tokens']} tokens each (tok/s: median of {meta['repeats']} (min-max)):",
                    "",
                    "| B | no cache tok/s | cache on tok/s | cache on / no cache | cache hits (tokens) during the runs |",
                    "|---|---|---|---|---|",
                    f"| {row['batch']} | {with_spread(row['no_cache_tok_s'], row['no_cache_spread'], '.1f')} | "
                    f"{with_spread(row['cache_tok_s'], row['cache_spread'], '.1f')} | "
                    f"{_ratio_cell(row['ratio'], row['ratio_spread'])} | {row['hits']} ({row['hit_tokens']} of "
                    f"{row['lookup_tokens']} looked up) |",
                    "",
                    f"cache on / no cache: target >= {target:g}: median {_target(row['ratio'] >= target)}; the range "
                    f"{lo:.3f}-{hi:.3f} {'lies above' if lo >= target else 'lies below' if hi < target else 'includes'} it.",
                    *_outside_line(row.get("outside_steps_s") or {}),
                ]
            )
        )
    if not meta.get("complete", False):
        parts.append(f"incomplete run: parts done {meta.get('parts_done')}.")
    return "\n\n".join(parts) + "\n"


def write_prefix(result: dict[str, Any], out: Path) -> str:
    """The prefix scenario's JSON, Markdown and PNG for the parts finished so far; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    write_whole(out / "prefix_cache.json", json.dumps(result, indent=2))
    md = prefix_markdown(result)
    write_whole(out / "prefix_cache.md", md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ttft, chats, row = result.get("ttft"), result.get("chats") or [], result.get("throughput")
    if ttft:
        mids = [ttft["cold_ms"], ttft["warm_ms"]]
        lohi = [ttft["cold_spread_ms"], ttft["warm_spread_ms"]]
        axes[0].bar(
            ["cold", "warm"],
            mids,
            yerr=[[m - s[0] for m, s in zip(mids, lohi)], [s[1] - m for m, s in zip(mids, lohi)]],
            capsize=4,
        )
        axes[0].set(ylabel="TTFT ms (median, whiskers min-max)", title=f"cold / warm = {ttft['cold_over_warm']:.1f}x")
    if chats:
        turns = chats[0]["cache"]["turns"]
        xs = [t["turn"] for t in turns]
        axes[1].bar(
            xs, [t["prompt_tokens"] for t in turns], label="prompt tokens (cache-less prefill)", color="lightgrey"
        )
        axes[1].bar(xs, [t["computed_tokens"] for t in turns], label="prefilled with the cache")
        axes[1].set(xlabel="turn (first conversation)", ylabel="tokens", title="multi-turn chat", xticks=xs)
        axes[1].legend(fontsize=8)
    if row:
        mids = [row["no_cache_tok_s"], row["cache_tok_s"]]
        lohi = [row["no_cache_spread"], row["cache_spread"]]
        axes[2].bar(
            ["no cache", "cache on, 0 % hits"],
            mids,
            yerr=[[m - s[0] for m, s in zip(mids, lohi)], [s[1] - m for m, s in zip(mids, lohi)]],
            capsize=4,
        )
        axes[2].set(ylabel="generated tok/s (median, whiskers min-max)", title=f"B = {row['batch']}")
    fig.suptitle(f"prefix cache: {result['meta']['model']} on {result['meta']['device']}")
    save_png(fig, out / "prefix_cache.png")
    return md
