"""Accounting for pins: which forwards ran at which level, who asked, and what it cost.

Every forward of the target goes through ``CountedModel``, which records the level in force when
the forward's graph was built, whether that forward asked for it (a scoped pin) or inherited it
from the process (the bench's process-wide pin arm), and how many token rows it carried. A forward at a
non-wide level that did not ask for it is **collateral**: work that paid a pin it did not need.
With scoped pins collateral is zero by construction; the counters prove it.

``CountedModel`` also gives every single-sequence forward's KV caches a layout-stable growth step
(``kernels.stabilize_layout``): a burst's verify and its classic steps then see one buffer layout
for the whole burst. Batched forwards' caches are left as mlx-lm makes them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from workers.api import Level
from workers.kernels import current_level, in_scoped_pin, process_scope, scoped, stabilize_layout, wrap_caches

_purpose: ContextVar[str] = ContextVar("mlx_batchd_forward_purpose", default="serving")


@dataclass
class LevelCounts:
    forwards: int = 0
    rows: int = 0
    seconds: float = 0.0


@dataclass
class PinLedger:
    """Counters keyed by (level, purpose). ``requested`` forwards asked for their level."""

    requested: dict[tuple[str, str], LevelCounts] = field(default_factory=dict)
    inherited: dict[tuple[str, str], LevelCounts] = field(default_factory=dict)

    def record_forward(self, level: Level, purpose: str, requested: bool, rows: int) -> None:
        table = self.requested if requested else self.inherited
        counts = table.setdefault((level.value, purpose), LevelCounts())
        counts.forwards += 1
        counts.rows += rows

    def record_seconds(self, level: Level, purpose: str, requested: bool, seconds: float) -> None:
        table = self.requested if requested else self.inherited
        table.setdefault((level.value, purpose), LevelCounts()).seconds += seconds

    @property
    def collateral_forwards(self) -> int:
        return sum(c.forwards for (level, _), c in self.inherited.items() if level != Level.WIDE)

    @property
    def collateral_seconds(self) -> float:
        return sum(c.seconds for (level, _), c in self.inherited.items() if level != Level.WIDE)

    def snapshot(self) -> dict[str, Any]:
        def rows(table: dict[tuple[str, str], LevelCounts]) -> list[dict[str, Any]]:
            return [
                {"level": lv, "purpose": p, "forwards": c.forwards, "rows": c.rows, "seconds": c.seconds}
                for (lv, p), c in sorted(table.items())
            ]

        return {
            "pinned": rows(self.requested),
            "unrequested": rows(self.inherited),
            "collateral_forwards": self.collateral_forwards,
            "collateral_seconds": self.collateral_seconds,
        }


class CountedModel:
    """The target as the engine and ``BatchGenerator`` see it: the same model, every forward
    counted, and caches wrapped for per-query attention when a single-sequence forward runs at
    that level."""

    def __init__(self, model: Any, ledger: PinLedger) -> None:
        self.model = model
        self.ledger = ledger

    def _prepare(self, inputs: Any, cache: Any) -> Any:
        level = current_level()
        self.ledger.record_forward(level, _purpose.get(), in_scoped_pin(), int(inputs.size))
        if cache is None or inputs.shape[0] != 1:
            return cache
        stabilize_layout(cache)  # a single sequence's own caches (batched ones are not KVCache)
        if level.per_query and inputs.shape[1] > 1:
            return wrap_caches(cache)
        return cache

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        return self.model(inputs, cache=self._prepare(inputs, cache), **kwargs)

    def with_hidden(self, inputs: Any, cache: Any) -> tuple[Any, Any]:
        """``(logits, hidden)``: the transformer's output before the head, for MTP drafters."""
        from workers.models import target_forward

        return target_forward(self.model, inputs, self._prepare(inputs, cache))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@contextmanager
def pinned(ledger: PinLedger, level: Level, purpose: str) -> Iterator[None]:
    """Run the block's forwards at ``level``, counted as requested by ``purpose``. Evaluate the
    outputs inside the block so the seconds recorded are the forward's real cost."""
    token = _purpose.set(purpose)
    tic = time.perf_counter()
    try:
        with scoped(level):
            yield
    finally:
        ledger.record_seconds(level, purpose, True, time.perf_counter() - tic)
        _purpose.reset(token)


@contextmanager
def unpinned(purpose: str = "serving") -> Iterator[None]:
    """Serving work: runs at the process level whatever scope the caller is in. Batched decode and
    prefill go through here, so a pin around some other forward can never reach them."""
    token = _purpose.set(purpose)
    try:
        with process_scope():
            yield
    finally:
        _purpose.reset(token)
