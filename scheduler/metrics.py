"""The daemon's Prometheus families (``mlx_batchd_``) of the numbers the ``stats`` reply carries.

The event loop publishes a stats snapshot a few times a second; a scrape reads the latest snapshot,
so it never touches live daemon state and never waits on the engine. Labels are bounded: tenants
come from the tenants file, outcomes, levels, purposes and decline reasons from fixed sets in the
code. ``scheduler.exposition`` serves them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler.stats_types import BurstSummary, EngineSnapshot, StatsReply, engine_of, read_stats

PREFIX = "mlx_batchd"


_Family = type[GaugeMetricFamily] | type[CounterMetricFamily]

#: One-number families of the front end's counters: (family, name, help, read).
_FRONT: tuple[tuple[_Family, str, str, Callable[[StatsReply], float]], ...] = (
    (
        GaugeMetricFamily,
        "clients_paused",
        "Connections whose sequences are paused because their unsent messages reached the bound",
        lambda s: s["clients_paused"],
    ),
    (
        GaugeMetricFamily,
        "parked_sequences",
        "Sequences of connections that stopped reading, parked with their KV; their decode slots went to others",
        lambda s: s.get("sequences_parked", 0),
    ),
    (
        GaugeMetricFamily,
        "unsent_messages",
        "Messages waiting in the daemon's per-connection outboxes (beyond ZeroMQ's queue)",
        lambda s: s["unsent_messages"],
    ),
    (
        CounterMetricFamily,
        "clients_dropped",
        "Connections that went away (or fell silent past the heartbeat timeout) with requests in flight",
        lambda s: s["clients_dropped"],
    ),
    (
        CounterMetricFamily,
        "messages_dropped",
        "Messages not answered because their connection's outbox was full (it was not reading)",
        lambda s: s["messages_dropped"],
    ),
)

#: One-number families of the engine's part, 0 before the model is loaded: (family, name, help, read).
_ENGINE: tuple[tuple[_Family, str, str, Callable[[EngineSnapshot], float]], ...] = (
    (GaugeMetricFamily, "paused_sequences", "Sequences paused for a slow reader", lambda e: e["paused"]),
    (GaugeMetricFamily, "active_sequences", "Sequences in the engine", lambda e: e["active_sequences"]),
    (GaugeMetricFamily, "decode_batch_size", "Sequences in the decode batch now", lambda e: e["batch_size"]),
    (
        CounterMetricFamily,
        "prefix_cache_queries",
        "Prompts looked up in the prefix cache",
        lambda e: e["prefix_cache"].get("queries", 0),
    ),
    (
        CounterMetricFamily,
        "prefix_cache_hits",
        "Prompt tokens served from the prefix cache (not prefilled)",
        lambda e: e["prefix_cache"].get("hit_tokens", 0),
    ),
    (
        GaugeMetricFamily,
        "prefix_cache_bytes",
        "Bytes of KV held by the prefix cache",
        lambda e: e["prefix_cache"].get("bytes", 0),
    ),
    (
        CounterMetricFamily,
        "prefix_cache_evictions",
        "Prefix cache entries dropped to stay under its byte bound",
        lambda e: e["prefix_cache"].get("evictions", 0),
    ),
    (CounterMetricFamily, "decode_steps", "Batched decode steps", lambda e: e["decode_steps"]),
    (
        CounterMetricFamily,
        "decode_seconds",
        "Seconds spent in batched decode steps",
        lambda e: e["decode_seconds"],
    ),
    (
        CounterMetricFamily,
        "step_cpu_seconds",
        "CPU seconds the engine thread ran inside its steps (near the step seconds: the host sets the step)",
        lambda e: e["step_cpu_seconds"],
    ),
    (
        CounterMetricFamily,
        "step_preemptions",
        "Times the OS gave the engine thread's CPU to another thread inside a step (0 where not counted)",
        lambda e: e["step_preemptions"],
    ),
    (CounterMetricFamily, "prefill_steps", "Engine steps that ran a prefill chunk", lambda e: e["prefill_steps"]),
    (
        CounterMetricFamily,
        "finish_steps",
        "Engine steps in which a sequence of the decode batch finished (each filters every layer's cache)",
        lambda e: e["finish_steps"],
    ),
)

#: Burst counters, labelled by drafter: (name, help, read).
_BURSTS: tuple[tuple[str, str, Callable[[BurstSummary], float]], ...] = (
    ("rounds", "Speculative burst rounds", lambda b: b["rounds"]),
    ("drafted_tokens", "Tokens proposed by the drafter", lambda b: b["drafted_tokens"]),
    ("accepted_tokens", "Drafted tokens the target accepted", lambda b: b["accepted_tokens"]),
    ("audits", "Burst rounds re-checked against a single-token forward", lambda b: b["audits"]),
    ("audit_failures", "Audits that found the verify diverging from classic decode", lambda b: b["audit_failures"]),
    ("ahead_rounds", "Burst rounds whose verify was built while the previous round ran", lambda b: b["ahead_rounds"]),
    (
        "fused_rounds",
        "Burst rounds whose drafts were computed with the verify in one evaluation",
        lambda b: b["fused_rounds"],
    ),
    ("round_seconds", "Seconds spent in burst rounds, drafting to emitting", lambda b: b["round_seconds"]),
)


class StatsCollector(Collector):
    """Families from the latest published ``stats`` reply (nothing before the first one)."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        published = self._snapshot()
        if not published:
            return
        s = read_stats(published)
        engine = engine_of(s)
        yield GaugeMetricFamily(
            f"{PREFIX}_requests_in_flight", "Requests admitted and not ended", value=s["requests_in_flight"]
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_requests_waiting", "Requests waiting for a decode slot", value=s["requests_waiting"]
        )

        requests = CounterMetricFamily(
            f"{PREFIX}_requests", "Requests that ended, by tenant and outcome", labels=["tenant", "outcome"]
        )
        for tenant, outcomes in s["outcomes"].items():
            for outcome, n in outcomes.items():
                requests.add_metric([tenant, outcome], n)
        yield requests

        tokens = CounterMetricFamily(f"{PREFIX}_tokens", "Tokens served, by tenant and kind", labels=["tenant", "kind"])
        waiting = GaugeMetricFamily(
            f"{PREFIX}_tenant_waiting_requests", "Requests waiting, by tenant", labels=["tenant"]
        )
        active = GaugeMetricFamily(
            f"{PREFIX}_tenant_active_sequences", "Sequences decoding, by tenant", labels=["tenant"]
        )
        for tenant, t in s["tenants"].items():
            tokens.add_metric([tenant, "prompt"], t["served_prompt_tokens"])
            tokens.add_metric([tenant, "generated"], t["served_generated_tokens"])
            waiting.add_metric([tenant], t["waiting"])
            active.add_metric([tenant], t["active"])
        yield from (tokens, waiting, active)

        for make, name, help_, read in _FRONT:
            yield make(f"{PREFIX}_{name}", help_, value=read(s))
        for make, name, help_, read_engine in _ENGINE:
            yield make(f"{PREFIX}_{name}", help_, value=0 if engine is None else read_engine(engine))
        memory = GaugeMetricFamily(
            f"{PREFIX}_mlx_memory_bytes",
            "The engine's MLX memory: active (in arrays), cache (freed buffers kept for reuse), peak",
            labels=["kind"],
        )
        m = None if engine is None else engine["memory"]
        memory.add_metric(["active"], 0 if m is None else m["active_bytes"])
        memory.add_metric(["cache"], 0 if m is None else m["cache_bytes"])
        memory.add_metric(["peak"], 0 if m is None else m["peak_bytes"])
        yield memory
        yield from _engine_families(engine)


def _engine_families(engine: EngineSnapshot | None) -> Iterator[Metric]:
    """Bursts, pins, the pin tax and verdicts: families with labels (zero or empty before the model
    is loaded, so a scrape while loading shows the same families)."""
    bursts = None if engine is None else engine["bursts"]
    drafter = (None if bursts is None else bursts["drafter"]) or "none"
    for key, help_, read in _BURSTS:
        family = CounterMetricFamily(f"{PREFIX}_burst_{key}", help_, labels=["drafter"])
        family.add_metric([drafter], 0 if bursts is None else read(bursts))
        yield family
    declined = CounterMetricFamily(f"{PREFIX}_bursts_declined", "Bursts not run, by reason", labels=["reason"])
    for reason, n in ({} if bursts is None else bursts["declined"]).items():
        declined.add_metric([reason], n)
    yield declined

    pins = None if engine is None else engine["pins"]
    forwards = CounterMetricFamily(
        f"{PREFIX}_pinned_forwards", "Forwards that asked for a kernel level", labels=["level", "purpose"]
    )
    seconds = CounterMetricFamily(f"{PREFIX}_pinned_seconds", "Seconds of pinned forwards", labels=["level", "purpose"])
    for row in [] if pins is None else pins["pinned"]:
        forwards.add_metric([row["level"], row["purpose"]], row["forwards"])
        seconds.add_metric([row["level"], row["purpose"]], row["seconds"])
    yield from (forwards, seconds)
    yield CounterMetricFamily(
        f"{PREFIX}_pin_collateral_forwards",
        "Forwards that ran pinned without asking (0 with scoped pins)",
        value=0 if pins is None else pins["collateral_forwards"],
    )
    yield CounterMetricFamily(
        f"{PREFIX}_pin_collateral_seconds",
        "Seconds of collateral pinned work",
        value=0.0 if pins is None else pins["collateral_seconds"],
    )
    tax = None if engine is None else engine["pin_tax"]
    if tax:
        ratio = GaugeMetricFamily(
            f"{PREFIX}_pin_tax_ratio",
            "Batched step time pinned / wide, measured by the probe, by level and batch size",
            labels=["level", "batch"],
        )
        for cost in tax["rows"]:
            ratio.add_metric([cost["level"], str(cost["batch"])], cost["ratio"])
        yield ratio
        yield GaugeMetricFamily(
            f"{PREFIX}_scoping_saved_seconds",
            "Batched decode seconds a process-wide pin would have added (measured ratio x decode time by batch size)",
            value=tax["estimated_seconds_saved_by_scoping"],
        )
    verdicts = GaugeMetricFamily(
        f"{PREFIX}_verdict_exact", "1 if the pairing's verify is exact at its level", labels=["pairing", "level"]
    )
    probe_s = GaugeMetricFamily(
        f"{PREFIX}_verdict_probe_seconds", "How long the pairing's probe took", labels=["pairing"]
    )
    for pairing, v in ({} if engine is None else engine["verdicts"]).items():
        if "level" in v:
            verdicts.add_metric([pairing, v["level"] or "declined"], 1.0 if v["exact"] else 0.0)
            probe_s.add_metric([pairing], v["probe_seconds"])
    yield verdicts
    yield probe_s
    admission = None if engine is None else engine["admission"]
    yield CounterMetricFamily(
        f"{PREFIX}_admission_delayed",
        "Requests held past the engine iteration that took them, to join the batch in one prefill wave",
        value=0 if admission is None else admission["delayed"],
    )
    yield CounterMetricFamily(
        f"{PREFIX}_admission_idle_hold_seconds",
        "Seconds an idle engine held arrivals before starting them (a declared group gathering, the idle window)",
        value=0.0 if admission is None else admission["idle_hold_seconds"],
    )
    loop = None if engine is None else engine["loop"]
    yield CounterMetricFamily(
        f"{PREFIX}_engine_emit_seconds",
        "Seconds the engine thread spent handing its events to the front end",
        value=0.0 if loop is None else loop["emit_seconds"],
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_admission_held",
        "Requests held for the next prefill wave now",
        value=0 if admission is None else admission["held"],
    )
