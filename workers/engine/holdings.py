"""The engine's surface onto what it holds besides its sequences: the pin ledger and its counted
model (pins), the start-up work run between steps (``workers.engine.background``, then the probe),
the verdict holder (the probe and verdicts) and the burst runner (bursts). Each accessor
delegates in a line; ``Engine`` inherits them, so the engine loop, the stats and the tests read one
object.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx

from workers.api import BurstSettings, Level, PinScope
from workers.engine.background import Background, Steps
from workers.engine.prefill_pace import PrefillPace
from workers.engine.spec import Adaptive, BurstCounters, BurstRunner, BurstSeq, Drafter
from workers.exact import CountedModel, PinLedger, Verdict, Verdicts, paced, pin_cost_summary, pinned

#: Seconds a start-up unit's prefill forward is sized to last (``Holdings.paced``), and its fewest tokens.
START_UP_UNIT_S = 0.5
START_UP_MIN_TOKENS = 16


class Holdings:
    """Accessors for ``Engine``: the attributes below are set by its ``__init__``."""

    pin_scope: PinScope
    ledger: PinLedger
    counted: CountedModel
    runner: BurstRunner
    _verdicts: Verdicts
    background: Background
    decode_seconds_by_batch: dict[int, float]
    pace: PrefillPace
    prefill_tokens: int

    # ------------------------------------------------------------------ pins

    def pinned(self, level: Level, purpose: str = "verify") -> AbstractContextManager[None]:
        """``with engine.pinned(level): logits = engine.forward(...); mx.eval(logits)``: only the
        forwards built inside the block run at ``level``; they are counted as requested."""
        return pinned(self.ledger, level, purpose)

    def forward(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """One target forward at whatever level is in force (wide unless inside ``pinned``)."""
        return self.counted(inputs, cache=cache)

    def pin_tax_summary(self) -> dict[str, Any]:
        """What a process-wide pin would cost batched decode, as the serving pairing's verdict measured
        it, and what scoping saved so far (``workers.exact.pin_cost_summary``); empty without a verdict."""
        v = self.verdict(self.pairing) or next(iter(self.verdicts.values()), None)
        if v is None:
            return {}
        return pin_cost_summary(v.pin_cost, v.level, self.decode_seconds_by_batch, self.pin_scope == "process")

    # ------------------------------------------------------------------ start-up work and the probe

    @property
    def starting(self) -> bool:
        """Start-up work left to run between steps: a background piece (``background``) or the probe."""
        return self.background.pending or self._verdicts.probing

    def start_up_step(self) -> None:
        """One unit of start-up work: the first background piece's, else the probe's next draw (the
        probe's pairing names the kernel plans, so it starts once the pieces before it ended)."""
        if self.background.pending:
            self.background.step()
        else:
            self._verdicts.probe_step()

    def start_up_summary(self) -> dict[str, Any]:
        return self.background.summary()

    def paced(self, steps: Steps) -> Steps:
        """``steps`` (the prefix check, the probe) prefilling in chunks that last about
        ``START_UP_UNIT_S`` at the engine's measured speed when it starts (``workers.engine.prefill_pace``;
        none in lockstep, where the pace measures nothing): a request that arrives mid-unit, and a
        busy engine's share of start-up work, wait for no more than that on a slow machine."""
        return paced(steps, lambda: self.pace.within(START_UP_UNIT_S, self.prefill_tokens, least=START_UP_MIN_TOKENS))

    # ------------------------------------------------------------------ the probe and verdicts

    def start_probe(self, name: str, steps: Generator[str, None, Verdict]) -> None:
        """Queue a probe; ``probe_step`` advances it one forward at a time."""
        self._verdicts.start_probe(name, self.paced(steps))

    @property
    def probing(self) -> bool:
        return self._verdicts.probing

    def probe_step(self) -> Verdict | None:
        """Advance the probe by one unit (a forward); return the verdict when it is done."""
        return self._verdicts.probe_step()

    @property
    def verdicts(self) -> dict[str, Verdict]:
        """The verdicts by pairing name (the holder's own dict)."""
        return self._verdicts.by_name

    def verdict(self, name: str | None) -> Verdict | None:
        """The verdict for pairing ``name``, or ``None`` while it has none (or for no pairing)."""
        return self._verdicts.get(name)

    def verdict_summary(self) -> dict[str, Any]:
        return self._verdicts.summary()

    # ------------------------------------------------------------------ bursts

    def configure_bursts(self, drafter: Drafter, settings: BurstSettings, pairing: str) -> None:
        """Enable B = 1 bursts with ``drafter``; they run once ``pairing`` has a usable verdict."""
        self.runner.configure(drafter, settings, pairing)

    def burst_summary(self) -> dict[str, Any]:
        return self.runner.summary()

    @property
    def pairing(self) -> str | None:
        return self.runner.pairing

    @property
    def revoked(self) -> dict[str, str]:
        return self.runner.revoked

    @property
    def bursts(self) -> BurstCounters:
        return self.runner.counters

    @property
    def adaptive(self) -> Adaptive:
        return self.runner.adaptive

    @property
    def _burst(self) -> BurstSeq | None:
        return self.runner.current
