"""The engine's counters and gauges as the stats reply's ``stats.engine`` map (``EngineSnapshot``).

Read from any thread while the engine thread runs: the engine thread only ever replaces these ints
and lengths, and reading them is atomic under the GIL, so no lock is taken on the hot path. The
engine's parts return plain maps; each is cast to its part of the contract (``workers.api.stats``).
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx

from workers.api import EngineSnapshot
from workers.api.stats import (
    AdmissionSnapshot,
    BurstSummary,
    DistributedSnapshot,
    LoopSnapshot,
    PinsSnapshot,
    PinTax,
    PrefixCacheSnapshot,
    ProbingRow,
    StartUpRow,
    VerdictRow,
)
from workers.engine.engine import Engine
from workers.kernels import compiled_layers, dense_shadow


def engine_snapshot(
    engine: Engine, distributed: DistributedSnapshot, admission: AdmissionSnapshot, loop: LoopSnapshot
) -> EngineSnapshot:
    """``engine``'s counters and gauges, with ``distributed`` (which ranks serve it), the loop's
    ``admission`` waves and its own account (``loop``), and MLX's memory."""
    return {
        **engine.counters.snapshot(),
        "active_sequences": engine.active,
        "paused": engine.paused,
        "batch_size": engine.batch_size(),
        "pin_scope": engine.pin_scope,
        "pins": cast(PinsSnapshot, engine.ledger.snapshot()),
        "verdicts": cast(dict[str, VerdictRow | ProbingRow], engine.verdict_summary()),
        "bursts": cast(BurstSummary, engine.burst_summary()),
        "pin_tax": cast(PinTax, engine.pin_tax_summary()),
        "prefix_cache": {"enabled": False}
        if engine.prefix_cache is None
        else cast(PrefixCacheSnapshot, engine.prefix_cache.snapshot()),
        "memory": {
            "active_bytes": mx.get_active_memory(),
            "cache_bytes": mx.get_cache_memory(),
            "peak_bytes": mx.get_peak_memory(),
        },
        "admission": admission,
        "loop": loop,
        "distributed": distributed,
        "kernel_plans": engine.kernel_plans,
        "start_up": cast(dict[str, StartUpRow], engine.start_up_summary()),
        "ready_phases": engine.ready_phases,
        "compiled_layers": compiled_layers.running(engine.model),
        "dense_shadow_bytes": dense_shadow.resident_bytes(engine.model),
    }
