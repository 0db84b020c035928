"""A whole ``stats`` reply and a table-row reader: what the ``top``/``stats`` views, the
Prometheus collector and the prefix cache's counters are tested against."""

from __future__ import annotations

import re
from typing import cast

from scheduler.stats_types import PinTax, StatsReply, engine_of
from workers.api import Level


def _row(frame: str, label: str) -> list[str]:
    """The cells of the table row whose first cell is ``label``."""
    for line in frame.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells and cells[0] == label:
            return cells
    raise AssertionError(f"no row {label!r} in:\n{frame}")


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
        "front_end_cpus": [1],
        "engine": {
            "submitted": 4,
            "finished": 3,
            "prompt_tokens": 40,
            "generated_tokens": generated,
            "decode_steps": 10,
            "decode_seconds": 0.25,
            "steps": 12,
            "step_seconds": 0.3,
            "step_cpu_seconds": 0.2,
            "step_preemptions": 3,
            "step_errors": 0,
            "peak_batch_size": 4,
            "prefill_steps": 2,
            "finish_steps": 1,
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
                "ahead_rounds": 0,
                "fused_rounds": 0,
                "round_seconds": 0.25,
                "revoked": {},
                "speedup_estimate": None,
                "classic_step_s": None,
                "round_s": None,
                "last_pause": None,
                "ahead_round_s": {"on": None, "off": None},
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
                    "from_cache": False,
                },
            },
            "memory": {"active_bytes": 2**20, "cache_bytes": 0, "peak_bytes": 2**21},
            "admission": {"window_ms": 20.0, "idle_window_ms": 0.0, "held": 2, "delayed": 9, "idle_hold_seconds": 0.25},
            "loop": {"iterations": 40, "emit_seconds": 0.004, "cpus": [0]},
            "kernel_plans": {},
            "compiled_layers": 0,
            "dense_shadow_bytes": 0,
            "start_up": {"kernel plans": {"status": "done", "at": "4/4 shapes timed", "units": 6, "seconds": 1.5}},
            "ready_phases": {"set-up": 0.1, "weights": 0.5, "warm-up": 0.2},
        },
    }


def with_pin_tax(stats: StatsReply) -> StatsReply:
    """``stats`` whose verdict measured what a process-wide pin would cost (two rungs, two batch sizes)."""
    engine = engine_of(stats)
    assert engine is not None
    rows = [
        {"level": level, "batch": batch, "wide_step_s": 0.01, "pinned_step_s": 0.01 * ratio, "ratio": ratio}
        for level, by_batch in (("narrow", {1: 1.25, 8: 1.5}), ("per-query", {1: 2.0, 8: 3.0}))
        for batch, ratio in by_batch.items()
    ]
    engine["pin_tax"] = cast(PinTax, {"level": "narrow", "rows": rows, "estimated_seconds_saved_by_scoping": 1.75})
    return stats
