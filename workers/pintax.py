"""The pin's tax: what a process-wide pin would cost batched decode, measured on scratch caches.

A scoped pin narrows only verify forwards; a process-wide one narrows every batched step too. This
times one batched decode step at a level against wide (serving state untouched) and estimates the
decode seconds that scoping saved.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from workers import mlxlm
from workers.kernels import Level
from workers.pins import CountedModel, PinLedger, pinned
from workers.verdicts import PinScope


class PinTax:
    """The last measurement of the pin's tax for one model."""

    def __init__(
        self, model: Any, counted: CountedModel, ledger: PinLedger, vocab_size: int, pin_scope: PinScope
    ) -> None:
        self.model = model
        self.counted = counted
        self.ledger = ledger
        self.vocab_size = vocab_size
        self.pin_scope = pin_scope
        self.last: dict[str, Any] = {}

    def measure(self, batch: int, level: Level, reps: int = 3, context: int = 32) -> dict[str, Any]:
        """Time one batched decode step at ``level`` vs wide, at ``batch`` sequences, on scratch
        caches (serving state is untouched): what a process-wide pin would cost this batch."""
        batch = max(1, batch)
        caches = []
        for i in range(batch):
            c = make_prompt_cache(self.model)
            self.model(mx.array([[(7 * i + j) % self.vocab_size for j in range(context)]]), cache=c)
            caches.append(c)
        merged = mlxlm.merge_caches(caches)
        mx.eval([c.state for c in merged])
        step = mx.array([[1]] * batch)
        times: dict[str, list[float]] = {"wide": [], "pinned": []}
        for _ in range(reps + 1):
            for name, lv in (("wide", Level.WIDE), ("pinned", level)):
                tic = time.perf_counter()
                with pinned(self.ledger, lv, "tax"):
                    mx.eval(self.counted(step, cache=merged))
                times[name].append(time.perf_counter() - tic)
        wide = sorted(times["wide"][1:])[reps // 2]
        pin = sorted(times["pinned"][1:])[reps // 2]
        self.last = {
            "batch": batch,
            "level": level.value,
            "wide_step_s": wide,
            "pinned_step_s": pin,
            "ratio": pin / wide,
            "measured_at": time.time(),
        }
        return self.last

    def summary(self, decode_seconds: float) -> dict[str, Any]:
        """The last measurement and what scoping saved: the batched ``decode_seconds`` so far would
        each have cost ``ratio`` times as much under a process-wide pin."""
        if not self.last:
            return {}
        saved = 0.0 if self.pin_scope == "process" else (self.last["ratio"] - 1.0) * decode_seconds
        return {**self.last, "estimated_seconds_saved_by_scoping": saved}
