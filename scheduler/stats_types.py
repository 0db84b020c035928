"""The ``stats`` reply's shape, defined once: what ``scheduler.stats.build_stats`` produces and what
``mlx-batchd stats``, ``top``, the Prometheus exposition and the benchmarks read.

The reply is the front end's counters, per-tenant tables and the engine's part (``stats.engine``,
whose shape the engine owns: ``workers.api.stats``). On the wire it is a msgpack map with these keys;
``docs/protocol.md`` describes each. A reader holding a map from the wire (a client's ``stats()``,
the front end's published copy) makes it typed with ``read_stats``; ``engine_of`` gives the engine's
part, or ``None`` while the model is still loading.

Only typing and ``workers.api.stats`` (itself typing only) are imported at run time, so the
client-side commands do not load MLX.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, cast

from workers.api import EnginePart, EngineSnapshot, ready
from workers.api.stats import (
    BurstSummary,
    MemorySnapshot,
    PinCostRow,
    PinRow,
    PinsSnapshot,
    PinTax,
    PrefixCacheSnapshot,
    ProbingRow,
    VerdictRow,
)

__all__ = [
    "BurstSummary",
    "EngineSnapshot",
    "MemorySnapshot",
    "PinCostRow",
    "PinRow",
    "PinTax",
    "PinsSnapshot",
    "PrefixCacheSnapshot",
    "ProbingRow",
    "StatsReply",
    "TenantRow",
    "VerdictRow",
    "engine_of",
    "read_stats",
]


class TenantRow(TypedDict):
    """One tenant's share of the service (``scheduler.fairness``)."""

    weight: float
    #: Sequences decoding, and requests waiting for a decode slot.
    active: int
    waiting: int
    #: The fair queue's service counter: tokens served divided by the weight.
    virtual_counter: float
    served_prompt_tokens: int
    served_generated_tokens: int


class StatsReply(TypedDict):
    """The ``stats`` map of a ``stats`` reply. ``tenants`` and ``outcomes`` hold only the asker's own
    rows unless the asker is the operator (``scheduler.stats.visible_tenant``)."""

    uptime_s: float
    requests_in_flight: int
    messages_received: int
    messages_refused: int
    messages_dropped: int
    requests_completed: int
    requests_waiting: int
    kv_reserved_bytes: int
    kv_budget_bytes: int
    clients_paused: int
    #: Sequences whose connection stopped reading and whose decode slots went to others.
    sequences_parked: int
    unsent_messages: int
    clients_dropped: int
    #: Requests ended, by tenant then outcome: a finish reason (``stop``, ``length``,
    #: ``cancelled``) or, for one that ended in an error, its error code.
    outcomes: dict[str, dict[str, int]]
    tenants: dict[str, TenantRow]
    #: The CPUs the front end may run on (``None`` where the OS cannot say); the engine's are
    #: ``engine.loop.cpus`` (``scheduler.affinity``).
    front_end_cpus: list[int] | None
    engine: EnginePart


def read_stats(reply: Mapping[str, Any]) -> StatsReply:
    """The ``stats`` map of a reply read off the wire (or the front end's published copy). Nothing
    is checked: the daemon built it with ``build_stats``."""
    return cast(StatsReply, reply)


def engine_of(stats: StatsReply) -> EngineSnapshot | None:
    """The engine's part, or ``None`` before the model is loaded (the reply carries ``{}`` then; a
    reply without one, which ``top`` tolerates, reads the same)."""
    part = stats.get("engine")
    return part if part is not None and ready(part) else None
