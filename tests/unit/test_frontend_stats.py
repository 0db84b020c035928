"""The front end's stats and health replies, without a daemon: the reply as a tenant, as the operator
and across msgpack, the engine counters and health before the model loads."""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

import msgpack

from scheduler.admission import Limits
from scheduler.fairness import FairQueue
from scheduler.stats import Counters, build_stats, health_message, stats_message, visible_tenant
from scheduler.stats_types import StatsReply
from scheduler.tenants import Tenant, TenantTable
from tests.helpers.stats import stats_snapshot
from workers.engine.sequences import EngineCounters


def _tenants() -> TenantTable:
    """A table as loaded from a tenants file (the path is only what marks it so)."""
    return TenantTable(
        {
            "red": Tenant("red", keys=frozenset({"k-red"})),
            "blue": Tenant("blue", keys=frozenset({"k-blue"})),
            "ops": Tenant("ops", keys=frozenset({"k-ops"}), admin=True),
        },
        source=Path("tenants.toml"),
    )


def _stats(only: str | None) -> StatsReply:
    table = _tenants()
    return build_stats(
        only=only,
        uptime_s=1.0,
        tenants=table.tenants,
        fair=FairQueue(),
        counters=Counters(received=5, refused=1),
        completed=3,
        outcomes={"red": {"stop": 2}, "blue": {"length": 1}},
        requests_in_flight=0,
        kv_reserved_bytes=0,
        kv_budget_bytes=0,
        clients_paused=0,
        sequences_parked=0,
        unsent_messages=0,
        engine={},
    )


def test_a_tenant_sees_its_own_rows_and_the_operator_sees_all() -> None:
    table = _tenants()
    assert visible_tenant(table, table.tenants["red"]) == "red"
    assert visible_tenant(table, table.tenants["ops"]) is None
    mine = _stats(visible_tenant(table, table.tenants["red"]))
    assert set(mine["tenants"]) == {"red"} and mine["outcomes"] == {"red": {"stop": 2}}
    everything = _stats(visible_tenant(table, table.tenants["ops"]))
    assert set(everything["tenants"]) == {"red", "blue", "ops"} and set(everything["outcomes"]) == {"red", "blue"}
    assert mine["messages_received"] == everything["messages_received"] == 5  # aggregates for both
    assert stats_message("s1", mine)["stats"] is mine


def test_without_a_tenants_file_the_local_user_is_the_operator() -> None:
    from scheduler.tenants import LOCAL, local_table

    table = local_table()
    assert visible_tenant(table, table.tenants[LOCAL]) is None


def test_the_engine_counters_reach_the_reply_whole() -> None:
    """Every counter of ``EngineCounters`` has its key in ``stats.engine``, under its own name."""
    counters = EngineCounters(**{f.name: i + 1 for i, f in enumerate(fields(EngineCounters))})
    assert counters.snapshot() == asdict(counters)


def test_the_stats_reply_crosses_msgpack_as_plain_strings() -> None:
    """Enum-valued fields (levels) leave as their plain strings: clients and the HTTP door read the
    same map as before the reply had types."""
    stats = _stats(None)
    stats["engine"] = stats_snapshot(1.0, 0, 0, 0, 0)["engine"]
    wire = msgpack.unpackb(msgpack.packb(stats_message("s1", stats)))["stats"]
    assert wire == stats
    assert type(wire["engine"]["pins"]["pinned"][0]["level"]) is str


def test_health_reports_limits_before_the_model_is_loaded() -> None:
    msg = health_message("h", "loading", None, Limits(), 1234)
    assert msg["model"] is None and msg["status"] == "loading" and msg["limits"]["max_frame_bytes"] == 1234
