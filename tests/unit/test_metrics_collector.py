"""The Prometheus exposition of a ``stats`` reply, read by the collector on its own (no daemon)."""

from __future__ import annotations

from typing import Any

from scheduler.metrics import StatsCollector
from scheduler.stats_types import engine_of
from tests.helpers.stats import stats_snapshot, with_pin_tax


def _collect(stats: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in StatsCollector(lambda: stats).collect()
        for s in family.samples
    }


def test_the_collector_reads_each_part_of_the_reply() -> None:
    """Each family comes from its part of the reply; a loading daemon's reply (an empty engine part)
    gives the engine's families at zero, and nothing is exposed before the first reply."""
    stats = stats_snapshot(uptime=12.0, generated=1600, emitted=500, drafted=400, accepted=300)
    engine = engine_of(stats)
    assert engine is not None
    got = _collect(dict(stats))
    assert got[("mlx_batchd_requests_in_flight", ())] == stats["requests_in_flight"]
    assert got[("mlx_batchd_tokens_total", (("kind", "generated"), ("tenant", "local")))] == 1600
    assert got[("mlx_batchd_requests_total", (("outcome", "cancelled"), ("tenant", "local")))] == 1
    assert got[("mlx_batchd_decode_seconds_total", ())] == engine["decode_seconds"]
    assert got[("mlx_batchd_prefill_steps_total", ())] == engine["prefill_steps"] == 2
    assert got[("mlx_batchd_finish_steps_total", ())] == engine["finish_steps"] == 1
    assert got[("mlx_batchd_step_cpu_seconds_total", ())] == engine["step_cpu_seconds"] == 0.2
    assert got[("mlx_batchd_step_preemptions_total", ())] == engine["step_preemptions"] == 3
    assert got[("mlx_batchd_prefix_cache_hits_total", ())] == engine["prefix_cache"].get("hit_tokens")
    assert got[("mlx_batchd_mlx_memory_bytes", (("kind", "peak"),))] == engine["memory"]["peak_bytes"]
    assert got[("mlx_batchd_burst_accepted_tokens_total", (("drafter", "prompt-lookup"),))] == 300
    assert got[("mlx_batchd_bursts_declined_total", (("reason", "batch"),))] == engine["bursts"]["declined"]["batch"]
    assert got[("mlx_batchd_pinned_forwards_total", (("level", "wide"), ("purpose", "verify")))] == 7
    assert got[("mlx_batchd_verdict_exact", (("level", "wide"), ("pairing", "m+prompt-lookup k=3")))] == 1.0
    assert not any(name == "mlx_batchd_pin_tax_ratio" for name, _ in got)  # none measured yet
    assert got[("mlx_batchd_admission_delayed_total", ())] == engine["admission"]["delayed"] == 9
    assert got[("mlx_batchd_admission_held", ())] == 2
    assert got[("mlx_batchd_admission_idle_hold_seconds_total", ())] == engine["admission"]["idle_hold_seconds"] == 0.25
    assert got[("mlx_batchd_engine_emit_seconds_total", ())] == engine["loop"]["emit_seconds"] == 0.004

    loading = _collect({**stats, "engine": {}})
    assert loading[("mlx_batchd_requests_in_flight", ())] == stats["requests_in_flight"]
    for key in [
        ("mlx_batchd_active_sequences", ()),
        ("mlx_batchd_decode_steps_total", ()),
        ("mlx_batchd_prefix_cache_bytes", ()),
        ("mlx_batchd_mlx_memory_bytes", (("kind", "active"),)),
        ("mlx_batchd_burst_rounds_total", (("drafter", "none"),)),
        ("mlx_batchd_pin_collateral_forwards_total", ()),
        ("mlx_batchd_admission_delayed_total", ()),
        ("mlx_batchd_admission_idle_hold_seconds_total", ()),
        ("mlx_batchd_engine_emit_seconds_total", ()),
    ]:
        assert loading[key] == 0, key
    assert not any(name in ("mlx_batchd_verdict_exact", "mlx_batchd_pinned_forwards_total") for name, _ in loading)
    assert _collect({}) == {}


def test_the_pin_tax_is_one_ratio_per_rung_and_batch_size() -> None:
    """The probe's rows, each as ``mlx_batchd_pin_tax_ratio{level, batch}``, and what scoping saved."""
    got = _collect(dict(with_pin_tax(stats_snapshot(12.0, 1600, 500, 400, 300))))
    ratios = {
        dict(labels)["level"] + "@" + dict(labels)["batch"]: v
        for (n, labels), v in got.items()
        if n.endswith("pin_tax_ratio")
    }
    assert ratios == {"narrow@1": 1.25, "narrow@8": 1.5, "per-query@1": 2.0, "per-query@8": 3.0}
    assert got[("mlx_batchd_scoping_saved_seconds", ())] == 1.75
