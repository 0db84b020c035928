"""What ``mlx-batchd top`` draws: one frame of tables from a ``stats`` reply, and the rates that only
two snapshots give (tokens per second split into batched decode and B = 1 bursts, and the burst
acceptance and prefix cache hit rate over the last interval).

:func:`render` is a pure function of the snapshots, so it is tested on synthetic ones without a
daemon. Every key is read defensively: a daemon that is still loading (an empty ``engine``), one
without a drafter, or an older daemon missing a counter shows ``-`` there instead of failing. The
reply is read as ``scheduler.stats_types.StatsReply`` and the helpers take the values read (``float |
None``), so a key the contract does not have is a type error, not a silent ``-``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from scheduler.stats_types import BurstSummary, EngineSnapshot, StatsReply, engine_of, read_stats

#: What a missing or not-yet-computable value shows as.
MISSING = "-"


def render(stats: Mapping[str, Any], previous: Mapping[str, Any] | None, dt: float) -> RenderableType:
    """One frame for ``stats`` (a reply's ``stats`` map). With a ``previous`` one taken ``dt`` seconds
    earlier it adds rates; without one (or with counters that went backwards) the rates show ``-``."""
    now = read_stats(stats)
    before = None if previous is None else read_stats(previous)
    engine = engine_of(now)
    prev_engine = None if before is None else engine_of(before)
    return Group(
        _overview(now, engine, prev_engine, dt),
        _verdicts(engine),
        _tenants(now),
        _outcomes(now),
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
    now, before = _num(read_stats(stats).get("uptime_s")), _num(read_stats(previous).get("uptime_s"))
    if now is not None and before is not None:
        return now - before if now > before else 0.0
    return wall


def _overview(stats: StatsReply, engine: EngineSnapshot | None, prev_engine: EngineSnapshot | None, dt: float) -> Table:
    """Requests, engine occupancy and throughput. Tokens emitted by bursts are counted in both
    ``generated_tokens`` and ``bursts.emitted_tokens``; batched decode is the difference."""
    active = batch = peak = generated = steps = None
    if engine is not None:
        active, batch, peak = engine.get("active_sequences"), engine.get("batch_size"), engine.get("peak_batch_size")
        generated, steps = engine.get("generated_tokens"), engine.get("decode_steps")
    b, prev_b = _bursts_of(engine), _bursts_of(prev_engine)
    total = _rate(generated, None if prev_engine is None else prev_engine.get("generated_tokens"), dt)
    burst = _rate(
        None if b is None else b.get("emitted_tokens"), None if prev_b is None else prev_b.get("emitted_tokens"), dt
    )
    batched = total - burst if total is not None and burst is not None else None
    if total is not None and burst is None and not (b is not None and b.get("drafter")):
        batched = total  # no drafter: every token is batched decode

    uptime = _num(stats.get("uptime_s"))
    t = _kv_table("mlx-batchd")
    t.add_row("uptime", MISSING if uptime is None else f"{uptime:.0f}s")
    t.add_row("requests in flight", _int(stats.get("requests_in_flight")))
    t.add_row("requests waiting", _int(stats.get("requests_waiting")))
    t.add_row("requests completed", _int(stats.get("requests_completed")))
    t.add_row("messages refused", _int(stats.get("messages_refused")))
    t.add_row("active sequences", _int(active))
    t.add_row("batch size", f"{_int(batch)} (peak {_int(peak)})")
    t.add_row("tokens/s total", _fixed(total, 1))
    t.add_row("tokens/s batched", _fixed(batched, 1))
    t.add_row("tokens/s burst", _fixed(burst, 1))
    t.add_row("tokens generated", _int(generated))
    t.add_row("decode steps", _int(steps))
    budget = _num(stats.get("kv_budget_bytes"))
    if budget:
        t.add_row("kv reserved", f"{_mib(_num(stats.get('kv_reserved_bytes')))} / {_mib(budget)} MiB")
    return t


def _verdicts(engine: EngineSnapshot | None) -> Table:
    """One row per pairing: its verify level and exactness once probed, or where its probe is."""
    t = Table(title="engine state", title_justify="left", expand=False)
    t.add_column("pairing", no_wrap=True)
    t.add_column("level")
    t.add_column("exact")
    t.add_column("probe s", justify="right")
    t.add_column("reason", overflow="fold")
    verdicts = (engine.get("verdicts") if engine is not None else None) or {}
    for name, v in verdicts.items():
        if "level" in v:
            exact = v.get("exact")
            t.add_row(
                str(name),
                str(v["level"] or "declined"),
                MISSING if exact is None else ("exact" if exact else "inexact"),
                _fixed(_num(v.get("probe_seconds")), 2) + (" (memoised)" if v.get("from_cache") else ""),
                str(v.get("reason") or MISSING),
            )
        else:
            t.add_row(str(name), "probing", MISSING, MISSING, f"at {v.get('at') or MISSING}")
    if not verdicts:
        t.add_row("(none)", MISSING, MISSING, MISSING, "no pairing probed" if engine else "engine not ready")
    return t


def _tenants(stats: StatsReply) -> Table:
    """Per tenant: requests ended (summed over outcomes), in flight (decoding + waiting), tokens.
    Tenants that only appear in ``outcomes`` (removed from the tenants file) still get a row."""
    tenants = stats.get("tenants") or {}
    outcomes = stats.get("outcomes") or {}
    t = Table(title="tenants", title_justify="left")
    for column in ("tenant", "weight", "requests", "in flight", "waiting", "prompt tok", "gen tok"):
        t.add_column(column, justify="left" if column == "tenant" else "right")
    for name in [*tenants, *(n for n in outcomes if n not in tenants)]:
        row = tenants.get(name)
        ended = sum(int(n) for n in (outcomes.get(name) or {}).values())
        active = None if row is None else _num(row.get("active"))
        waiting = None if row is None else _num(row.get("waiting"))
        in_flight = MISSING if active is None or waiting is None else str(int(active + waiting))
        t.add_row(
            str(name),
            _fixed(None if row is None else _num(row.get("weight")), 1),
            str(ended),
            in_flight,
            _int(waiting),
            _int(None if row is None else row.get("served_prompt_tokens")),
            _int(None if row is None else row.get("served_generated_tokens")),
        )
    return t


def _outcomes(stats: StatsReply) -> Table:
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


def _bursts(engine: EngineSnapshot | None, prev_engine: EngineSnapshot | None) -> Table:
    """Speculative B = 1 bursts. Acceptance is shown over the daemon's life and over the last
    interval, because the adaptive controller reacts to the recent rate, not the lifetime one."""
    b, prev_b = _bursts_of(engine), _bursts_of(prev_engine)
    t = _kv_table("bursts")
    drafter = None if b is None else b.get("drafter")
    if b is None or not drafter:
        t.add_row("drafter", "none (bursts off)")
        return t
    drafted, accepted = _num(b.get("drafted_tokens")), _num(b.get("accepted_tokens"))
    d_drafted = d_accepted = None
    if prev_b is not None:
        d_drafted = _delta(b.get("drafted_tokens"), prev_b.get("drafted_tokens"))
        d_accepted = _delta(b.get("accepted_tokens"), prev_b.get("accepted_tokens"))
    declined = b.get("declined") or {}
    revoked = b.get("revoked") or {}
    t.add_row("drafter", f"{drafter} k={b.get('k', MISSING)}" + (" (in a burst)" if b.get("active") else ""))
    t.add_row("rounds", _int(b.get("rounds")))
    t.add_row("drafted", _int(drafted))
    t.add_row("accepted", _int(accepted))
    t.add_row("acceptance", _fixed(_ratio(accepted, drafted), 2))
    t.add_row("acceptance (interval)", _fixed(_ratio(d_accepted, d_drafted), 2))
    t.add_row("emitted", _int(b.get("emitted_tokens")))
    t.add_row("declined", ", ".join(f"{r} {n}" for r, n in sorted(declined.items())) or "0")
    t.add_row("audits", f"{_int(b.get('audits'))} ({_int(b.get('audit_failures'))} failed)")
    if revoked:
        t.add_row("revoked", ", ".join(f"{r} {n}" for r, n in sorted(revoked.items())))
    speedup = _num(b.get("speedup_estimate"))
    if speedup is not None:
        t.add_row("speedup estimate", f"{speedup:.2f}x")
    return t


def _prefix_cache(engine: EngineSnapshot | None, prev_engine: EngineSnapshot | None) -> Table:
    """The prefix cache (``serve --prefix-cache-mb``): the share of looked-up prompt tokens it served,
    over the daemon's life and over the last interval (a workload change shows there first), and the
    KV bytes it holds against its bound."""
    pc = None if engine is None else engine.get("prefix_cache")
    t = _kv_table("prefix cache")
    if pc is None or not pc.get("enabled"):
        t.add_row("state", "off")
        return t
    prev = None if prev_engine is None else prev_engine.get("prefix_cache")
    looked_up = hit = None
    if prev_engine is not None:
        looked_up = _delta(pc.get("lookup_tokens"), None if prev is None else prev.get("lookup_tokens"))
        hit = _delta(pc.get("hit_tokens"), None if prev is None else prev.get("hit_tokens"))
    verdict = pc.get("verdict")
    why = (None if verdict is None else verdict.get("reason")) or MISSING
    t.add_row("state", "serving" if pc.get("serving") else f"declined ({why})")
    t.add_row("hit rate", _percent(_num(pc.get("hit_rate"))))
    t.add_row("hit rate (interval)", _percent(_ratio(hit, looked_up)))
    t.add_row("hits / queries", f"{_int(pc.get('hits'))} / {_int(pc.get('queries'))}")
    t.add_row("tokens from the cache", f"{_int(pc.get('hit_tokens'))} of {_int(pc.get('lookup_tokens'))}")
    t.add_row("bytes", f"{_mib1(_num(pc.get('bytes')))} / {_mib1(_num(pc.get('max_bytes')))} MiB")
    t.add_row("entries", _int(pc.get("entries")))
    t.add_row("evictions", _int(pc.get("evictions")))
    return t


def _pins(engine: EngineSnapshot | None) -> Table:
    """Kernel-level pin accounting: forwards that asked for a level, and collateral ones that ran
    pinned without asking (nonzero only under a process-wide pin), plus what one would cost if measured."""
    pins = None if engine is None else engine.get("pins")
    scope = None if engine is None else engine.get("pin_scope")
    t = Table(title=f"pins (scope {scope or MISSING})", title_justify="left")
    t.add_column("level")
    t.add_column("purpose")
    t.add_column("forwards", justify="right")
    t.add_column("seconds", justify="right")
    for row in (None if pins is None else pins.get("pinned")) or []:
        t.add_row(
            str(row.get("level", MISSING)),
            str(row.get("purpose", MISSING)),
            _int(row.get("forwards")),
            _fixed(_num(row.get("seconds")), 2),
        )
    t.add_row(
        "collateral",
        "(unrequested)",
        _int(None if pins is None else pins.get("collateral_forwards")),
        _fixed(_num(None if pins is None else pins.get("collateral_seconds")), 2),
    )
    tax = (None if engine is None else engine.get("pin_tax")) or {}
    level = tax.get("level")
    ratios = [
        f"B={r.get('batch', MISSING)} {_fixed(_num(r.get('ratio')), 3)}x"
        for r in tax.get("rows") or []
        if r.get("level") == level
    ]
    if ratios:
        saved = _num(tax.get("estimated_seconds_saved_by_scoping"))
        t.caption = f"pin tax at {level} (pinned / wide): {', '.join(ratios)}; scoping saved ~{_fixed(saved, 2)}s"
        t.caption_justify = "left"
    return t


# ---------------------------------------------------------------------------------------------- helpers


def _kv_table(title: str) -> Table:
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value", justify="right")
    return t


def _bursts_of(engine: EngineSnapshot | None) -> BurstSummary | None:
    return None if engine is None else engine.get("bursts")


def _num(v: float | None) -> float | None:
    """``v`` as a number, or ``None`` when absent or not numeric (never raises: the reply came
    off the wire, and an older daemon may send something else)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _delta(now: float | None, before: float | None) -> float | None:
    """Counter growth between snapshots; ``None`` if either lacks it or it went backwards (the
    daemon restarted between polls)."""
    a, b = _num(now), _num(before)
    if a is None or b is None or a < b:
        return None
    return a - b


def _rate(now: float | None, before: float | None, dt: float) -> float | None:
    if dt <= 0:
        return None
    d = _delta(now, before)
    return None if d is None else d / dt


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _int(v: float | None) -> str:
    n = _num(v)
    return MISSING if n is None else str(int(n))


def _fixed(v: float | None, digits: int) -> str:
    return MISSING if v is None else f"{v:.{digits}f}"


def _mib(v: float | None) -> str:
    return MISSING if v is None else f"{v / 2**20:.0f}"


def _mib1(v: float | None) -> str:
    return MISSING if v is None else f"{v / 2**20:.1f}"


def _percent(v: float | None) -> str:
    return MISSING if v is None else f"{v * 100:.1f} %"
