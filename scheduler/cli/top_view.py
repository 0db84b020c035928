"""What ``mlx-batchd top`` draws: one frame of tables from a ``stats`` reply, and the rates that only
two snapshots give (tokens per second split into batched decode and B = 1 bursts, and the burst
acceptance and prefix cache hit rate over the last interval).

:func:`render` is a pure function of the snapshots, so it is tested on synthetic ones without a
daemon. Every key is read defensively: a daemon that is still loading (an empty ``engine``), one
without a drafter, or an older daemon missing a counter shows ``-`` there instead of failing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

#: What a missing or not-yet-computable value shows as.
MISSING = "-"


def render(stats: dict[str, Any], previous: dict[str, Any] | None, dt: float) -> RenderableType:
    """One frame for ``stats``. With a ``previous`` snapshot taken ``dt`` seconds earlier it adds
    rates; without one (or with counters that went backwards) the rates show ``-``."""
    engine: Mapping[str, Any] = stats.get("engine") or {}
    prev_engine: Mapping[str, Any] | None = (previous.get("engine") or {}) if previous is not None else None
    return Group(
        _overview(stats, engine, prev_engine, dt),
        _verdicts(engine),
        _tenants(stats),
        _outcomes(stats),
        _bursts(engine, prev_engine),
        _prefix_cache(engine, prev_engine),
        _pins(engine),
    )


def between(stats: Mapping[str, Any], previous: Mapping[str, Any] | None, wall: float) -> float:
    """Seconds between two snapshots: the daemon's uptime delta, else the local wall delta ``wall``;
    0 when there is no usable previous snapshot (first frame, or the daemon restarted). The daemon's
    own clock keeps rates from being skewed by how long a reply took to arrive."""
    if previous is None:
        return 0.0
    now, before = _num(stats, "uptime_s"), _num(previous, "uptime_s")
    if now is not None and before is not None:
        return now - before if now > before else 0.0
    return wall


def _overview(
    stats: Mapping[str, Any], engine: Mapping[str, Any], prev_engine: Mapping[str, Any] | None, dt: float
) -> Table:
    """Requests, engine occupancy and throughput. Tokens emitted by bursts are counted in both
    ``generated_tokens`` and ``bursts.emitted_tokens``; batched decode is the difference."""
    total = _rate(engine, prev_engine, ("generated_tokens",), dt)
    burst = _rate(engine, prev_engine, ("bursts", "emitted_tokens"), dt)
    batched = total - burst if total is not None and burst is not None else None
    if total is not None and burst is None and not (engine.get("bursts") or {}).get("drafter"):
        batched = total  # no drafter: every token is batched decode

    uptime = _num(stats, "uptime_s")
    t = _kv_table("mlx-batchd")
    t.add_row("uptime", MISSING if uptime is None else f"{uptime:.0f}s")
    t.add_row("requests in flight", _int(stats, "requests_in_flight"))
    t.add_row("requests waiting", _int(stats, "requests_waiting"))
    t.add_row("requests completed", _int(stats, "requests_completed"))
    t.add_row("messages refused", _int(stats, "messages_refused"))
    t.add_row("active sequences", _int(engine, "active_sequences"))
    t.add_row("batch size", f"{_int(engine, 'batch_size')} (peak {_int(engine, 'peak_batch_size')})")
    t.add_row("tokens/s total", _fixed(total, 1))
    t.add_row("tokens/s batched", _fixed(batched, 1))
    t.add_row("tokens/s burst", _fixed(burst, 1))
    t.add_row("tokens generated", _int(engine, "generated_tokens"))
    t.add_row("decode steps", _int(engine, "decode_steps"))
    budget = _num(stats, "kv_budget_bytes")
    if budget:
        t.add_row("kv reserved", f"{_mib(_num(stats, 'kv_reserved_bytes'))} / {_mib(budget)} MiB")
    return t


def _verdicts(engine: Mapping[str, Any]) -> Table:
    """One row per pairing: its verify level and exactness once probed, or where its probe is."""
    t = Table(title="engine state", title_justify="left", expand=False)
    t.add_column("pairing", no_wrap=True)
    t.add_column("level")
    t.add_column("exact")
    t.add_column("probe s", justify="right")
    t.add_column("reason", overflow="fold")
    verdicts: Mapping[str, Any] = engine.get("verdicts") or {}
    for name, v in verdicts.items():
        if "level" in v:
            exact = v.get("exact")
            t.add_row(
                str(name),
                str(v["level"] or "declined"),
                MISSING if exact is None else ("exact" if exact else "inexact"),
                _fixed(_num(v, "probe_seconds"), 2) + (" (memoised)" if v.get("from_cache") else ""),
                str(v.get("reason") or MISSING),
            )
        else:
            t.add_row(str(name), "probing", MISSING, MISSING, f"at {v.get('at') or MISSING}")
    if not verdicts:
        t.add_row("(none)", MISSING, MISSING, MISSING, "no pairing probed" if engine else "engine not ready")
    return t


def _tenants(stats: Mapping[str, Any]) -> Table:
    """Per tenant: requests ended (summed over outcomes), in flight (decoding + waiting), tokens.
    Tenants that only appear in ``outcomes`` (removed from the tenants file) still get a row."""
    tenants: Mapping[str, Any] = stats.get("tenants") or {}
    outcomes: Mapping[str, Any] = stats.get("outcomes") or {}
    t = Table(title="tenants", title_justify="left")
    for column in ("tenant", "weight", "requests", "in flight", "waiting", "prompt tok", "gen tok"):
        t.add_column(column, justify="left" if column == "tenant" else "right")
    for name in [*tenants, *(n for n in outcomes if n not in tenants)]:
        row: Mapping[str, Any] = tenants.get(name) or {}
        ended = sum(int(n) for n in (outcomes.get(name) or {}).values())
        active, waiting = _num(row, "active"), _num(row, "waiting")
        in_flight = MISSING if active is None or waiting is None else str(int(active + waiting))
        t.add_row(
            str(name),
            _fixed(_num(row, "weight"), 1),
            str(ended),
            in_flight,
            _int(row, "waiting"),
            _int(row, "served_prompt_tokens"),
            _int(row, "served_generated_tokens"),
        )
    return t


def _outcomes(stats: Mapping[str, Any]) -> Table:
    """Requests that ended, by outcome (stop / length / cancelled or an error code), all tenants."""
    totals: dict[str, int] = {}
    for per in (stats.get("outcomes") or {}).values():
        for outcome, n in per.items():
            totals[outcome] = totals.get(outcome, 0) + int(n)
    t = Table(title="requests by outcome", title_justify="left")
    t.add_column("outcome")
    t.add_column("requests", justify="right")
    for outcome, n in sorted(totals.items()):
        t.add_row(outcome, str(n))
    if not totals:
        t.add_row(MISSING, MISSING)
    return t


def _bursts(engine: Mapping[str, Any], prev_engine: Mapping[str, Any] | None) -> Table:
    """Speculative B = 1 bursts. Acceptance is shown over the daemon's life and over the last
    interval, because the adaptive controller reacts to the recent rate, not the lifetime one."""
    b: Mapping[str, Any] = engine.get("bursts") or {}
    t = _kv_table("bursts")
    if not b.get("drafter"):
        t.add_row("drafter", "none (bursts off)")
        return t
    prev_b: Mapping[str, Any] = (prev_engine.get("bursts") or {}) if prev_engine is not None else {}
    drafted, accepted = _num(b, "drafted_tokens"), _num(b, "accepted_tokens")
    d_drafted = _delta(b, prev_b, ("drafted_tokens",)) if prev_engine is not None else None
    d_accepted = _delta(b, prev_b, ("accepted_tokens",)) if prev_engine is not None else None
    declined: Mapping[str, Any] = b.get("declined") or {}
    revoked: Mapping[str, Any] = b.get("revoked") or {}
    t.add_row("drafter", f"{b['drafter']} k={b.get('k', MISSING)}" + (" (in a burst)" if b.get("active") else ""))
    t.add_row("rounds", _int(b, "rounds"))
    t.add_row("drafted", _int(b, "drafted_tokens"))
    t.add_row("accepted", _int(b, "accepted_tokens"))
    t.add_row("acceptance", _fixed(_ratio(accepted, drafted), 2))
    t.add_row("acceptance (interval)", _fixed(_ratio(d_accepted, d_drafted), 2))
    t.add_row("emitted", _int(b, "emitted_tokens"))
    t.add_row("declined", ", ".join(f"{r} {n}" for r, n in sorted(declined.items())) or "0")
    t.add_row("audits", f"{_int(b, 'audits')} ({_int(b, 'audit_failures')} failed)")
    if revoked:
        t.add_row("revoked", ", ".join(f"{r} {n}" for r, n in sorted(revoked.items())))
    speedup = _num(b, "speedup_estimate")
    if speedup is not None:
        t.add_row("speedup estimate", f"{speedup:.2f}x")
    return t


def _prefix_cache(engine: Mapping[str, Any], prev_engine: Mapping[str, Any] | None) -> Table:
    """The prefix cache (``serve --prefix-cache-mb``): the share of looked-up prompt tokens it served,
    over the daemon's life and over the last interval (a workload change shows there first), and the
    KV bytes it holds against its bound."""
    pc: Mapping[str, Any] = engine.get("prefix_cache") or {}
    t = _kv_table("prefix cache")
    if not pc.get("enabled"):
        t.add_row("state", "off")
        return t
    prev: Mapping[str, Any] = (prev_engine.get("prefix_cache") or {}) if prev_engine is not None else {}
    looked_up = _delta(pc, prev, ("lookup_tokens",)) if prev_engine is not None else None
    hit = _delta(pc, prev, ("hit_tokens",)) if prev_engine is not None else None
    verdict: Mapping[str, Any] = pc.get("verdict") or {}
    t.add_row("state", "serving" if pc.get("serving") else f"declined ({verdict.get('reason') or MISSING})")
    t.add_row("hit rate", _percent(_num(pc, "hit_rate")))
    t.add_row("hit rate (interval)", _percent(_ratio(hit, looked_up)))
    t.add_row("hits / queries", f"{_int(pc, 'hits')} / {_int(pc, 'queries')}")
    t.add_row("tokens from the cache", f"{_int(pc, 'hit_tokens')} of {_int(pc, 'lookup_tokens')}")
    t.add_row("bytes", f"{_mib1(_num(pc, 'bytes'))} / {_mib1(_num(pc, 'max_bytes'))} MiB")
    t.add_row("entries", _int(pc, "entries"))
    t.add_row("evictions", _int(pc, "evictions"))
    return t


def _pins(engine: Mapping[str, Any]) -> Table:
    """Kernel-level pin accounting: forwards that asked for a level, and collateral ones that ran
    pinned without asking (nonzero only under a process-wide pin), plus the measured tax if any."""
    pins: Mapping[str, Any] = engine.get("pins") or {}
    t = Table(title=f"pins (scope {engine.get('pin_scope') or MISSING})", title_justify="left")
    t.add_column("level")
    t.add_column("purpose")
    t.add_column("forwards", justify="right")
    t.add_column("seconds", justify="right")
    for row in pins.get("pinned") or []:
        t.add_row(
            str(row.get("level", MISSING)),
            str(row.get("purpose", MISSING)),
            _int(row, "forwards"),
            _fixed(_num(row, "seconds"), 2),
        )
    t.add_row(
        "collateral", "(unrequested)", _int(pins, "collateral_forwards"), _fixed(_num(pins, "collateral_seconds"), 2)
    )
    tax: Mapping[str, Any] = engine.get("pin_tax") or {}
    ratio = _num(tax, "ratio")
    if ratio is not None:
        saved = _num(tax, "estimated_seconds_saved_by_scoping")
        t.caption = (
            f"pin tax: batch {tax.get('batch', MISSING)} at {tax.get('level', MISSING)} = {ratio:.3f}x a wide step; "
            f"scoping saved ~{_fixed(saved, 2)}s"
        )
        t.caption_justify = "left"
    return t


# ---------------------------------------------------------------------------------------------- helpers


def _kv_table(title: str) -> Table:
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value", justify="right")
    return t


def _num(d: Mapping[str, Any] | None, key: str) -> float | None:
    """``d[key]`` as a number, or ``None`` when absent or not numeric (never raises)."""
    if not d:
        return None
    v = d.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _path(d: Mapping[str, Any] | None, path: tuple[str, ...]) -> float | None:
    for key in path[:-1]:
        d = (d or {}).get(key)
        if not isinstance(d, Mapping):
            return None
    return _num(d, path[-1])


def _delta(now: Mapping[str, Any], before: Mapping[str, Any] | None, path: tuple[str, ...]) -> float | None:
    """Counter growth between snapshots; ``None`` if either lacks it or it went backwards (the
    daemon restarted between polls)."""
    a, b = _path(now, path), _path(before, path)
    if a is None or b is None or a < b:
        return None
    return a - b


def _rate(now: Mapping[str, Any], before: Mapping[str, Any] | None, path: tuple[str, ...], dt: float) -> float | None:
    if before is None or dt <= 0:
        return None
    d = _delta(now, before, path)
    return None if d is None else d / dt


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _int(d: Mapping[str, Any] | None, key: str) -> str:
    v = _num(d, key)
    return MISSING if v is None else str(int(v))


def _fixed(v: float | None, digits: int) -> str:
    return MISSING if v is None else f"{v:.{digits}f}"


def _mib(v: float | None) -> str:
    return MISSING if v is None else f"{v / 2**20:.0f}"


def _mib1(v: float | None) -> str:
    return MISSING if v is None else f"{v / 2**20:.1f}"


def _percent(v: float | None) -> str:
    return MISSING if v is None else f"{v * 100:.1f} %"
