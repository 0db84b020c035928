"""The ``health`` and ``stats`` replies, and who may see what in them.

The operator (the local user without a tenants file, or a tenant with ``admin = true``) sees every
tenant; any other tenant sees its own rows of the per-tenant tables and the global aggregates. The
figures come in
as arguments, so a reply can be built (and checked) without a socket or an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clients.protocol import PROTOCOL_VERSION, MsgType
from scheduler.admission import Limits
from scheduler.affinity import allowed_cpus
from scheduler.fairness import FairQueue
from scheduler.stats_types import StatsReply, TenantRow
from scheduler.tenants import Tenant, TenantTable
from workers.api import EnginePart, ModelInfo


@dataclass
class Counters:
    """What the front end counts as messages come and go (the ``messages_*`` and ``clients_dropped``
    figures of ``stats``)."""

    received: int = 0
    refused: int = 0
    clients_dropped: int = 0
    messages_dropped: int = 0


def visible_tenant(table: TenantTable, tenant: Tenant) -> str | None:
    """The one tenant whose rows ``tenant`` may see, or ``None`` for all of them (the operator)."""
    return None if table.is_operator(tenant) else tenant.name


def stats_message(rid: str, stats: StatsReply) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": MsgType.STATS.value, "id": rid, "stats": stats}


def health_message(
    rid: str, status: str, info: ModelInfo | None, limits: Limits, max_frame_bytes: int
) -> dict[str, Any]:
    return {
        "v": PROTOCOL_VERSION,
        "type": MsgType.HEALTH.value,
        "id": rid,
        "status": status,
        "protocol": PROTOCOL_VERSION,
        "model": None
        if info is None
        else {
            "name": info.name,
            "type": info.model_type,
            "vocab_size": info.vocab_size,
            "context_length": info.context_length,
        },
        "limits": {
            "max_tokens": limits.max_tokens_cap,
            "default_max_tokens": limits.default_max_tokens,
            "max_frame_bytes": max_frame_bytes,
        },
    }


def tenant_stats(name: str, tenant: Tenant, fair: FairQueue[Any]) -> TenantRow:
    state = fair.state.get(name)
    return {
        "weight": tenant.weight,
        "active": state.active if state else 0,
        "waiting": fair.queued(name),
        "virtual_counter": state.counter if state else 0.0,
        "served_prompt_tokens": state.served_prompt_tokens if state else 0,
        "served_generated_tokens": state.served_generated_tokens if state else 0,
    }


def build_stats(
    *,
    only: str | None,
    uptime_s: float,
    tenants: Mapping[str, Tenant],
    fair: FairQueue[Any],
    counters: Counters,
    completed: int,
    outcomes: Mapping[str, Mapping[str, int]],
    requests_in_flight: int,
    kv_reserved_bytes: int,
    kv_budget_bytes: int,
    clients_paused: int,
    sequences_parked: int,
    unsent_messages: int,
    engine: EnginePart,
) -> StatsReply:
    """The ``stats`` reply (``scheduler.stats_types.StatsReply``), also what the metrics read.
    ``only`` limits the per-tenant tables (``tenants``, ``outcomes``) to that tenant."""
    return {
        "uptime_s": uptime_s,
        "requests_in_flight": requests_in_flight,
        "messages_received": counters.received,
        "messages_refused": counters.refused,
        "messages_dropped": counters.messages_dropped,
        "requests_completed": completed,
        "requests_waiting": len(fair),
        "kv_reserved_bytes": kv_reserved_bytes,
        "kv_budget_bytes": kv_budget_bytes,
        "clients_paused": clients_paused,
        "sequences_parked": sequences_parked,
        "unsent_messages": unsent_messages,
        "clients_dropped": counters.clients_dropped,
        "outcomes": {t: dict(per) for t, per in outcomes.items() if only is None or t == only},
        "tenants": {
            name: tenant_stats(name, tenant, fair) for name, tenant in tenants.items() if only is None or name == only
        },
        "front_end_cpus": None if (cpus := allowed_cpus()) is None else list(cpus),
        "engine": engine,
    }
