"""How many prompt tokens one prefill step may carry on this machine: as many as its measured speed
lets it run within a target time, so that no single engine step runs for long.

Why: one ``BatchGenerator`` step prefills a chunk of every prompt in its wave, up to
``prefill_tokens`` (4,096) in all. On a fast device that is a fraction of a second; on a slow CPU it
can be minutes, and the daemon's watchdog, which hears from the engine once per step, would take the
silence for a hung engine. A serving engine bounds a step's work by time, not only by tokens: the
engine sets ``step_target_s`` from the watchdog's limit, and each step's prefill is sized from the
seconds per forwarded row measured on the steps that prefilled (the warm-up's among them).

The estimate is conservative: a step's seconds are charged to every row it forwarded (its decode
rows and padding included), and the estimate is the largest of the latest ``WINDOW`` steps'. A step
that forwarded few rows overstates the cost of many (its fixed costs are shared by few): the budget
starts small after the warm-up's tiny steps and grows as bigger steps are measured, which from then
on are the ones read. The budget is never
below ``MIN_STEP_TOKENS`` (a step makes progress however slow the machine) and never above
``prefill_tokens``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

#: Prompt tokens a step may always carry, whatever the measured speed.
MIN_STEP_TOKENS = 64
#: Prefill steps whose speed the estimate reads (the largest seconds per row among them).
WINDOW = 4


class PrefillPace:
    """The measured seconds per forwarded row of the latest prefill steps, and the prefill budget of
    the next step that follows from them (``target_s`` 0: no time bound)."""

    def __init__(self, target_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.target_s = target_s
        #: What a step's seconds are read from (tests give a clock that counts forwarded rows).
        self.clock = clock
        #: The latest prefill steps: (rows forwarded, seconds per row).
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def record(self, rows: int, seconds: float) -> None:
        """A step that prefilled forwarded ``rows`` rows (decode rows included) in ``seconds``."""
        if rows > 0:
            self._steps.append((rows, seconds / rows))

    def seconds_per_row(self) -> float | None:
        """The estimate, or ``None`` before any was measured: the largest of the latest steps' that
        forwarded at least ``MIN_STEP_TOKENS`` rows, or where none did (the warm-up's), of all of them.
        A step of a few rows (a prompt's last few tokens) mostly measures the step's fixed costs."""
        big = [per_row for rows, per_row in self._steps if rows >= MIN_STEP_TOKENS]
        every = [per_row for _, per_row in self._steps]
        return max(big or every) if every else None

    def budget(self, prefill_tokens: int, decoding: int) -> int:
        """The prompt tokens the next step may carry: what fits ``target_s`` beside the ``decoding``
        rows its decode step forwards, at least ``MIN_STEP_TOKENS``, at most ``prefill_tokens``
        (which is all of it while nothing is measured or no target is set)."""
        return self.within(self.target_s, prefill_tokens, decoding, MIN_STEP_TOKENS)

    def within(self, seconds: float, most: int, decoding: int = 0, least: int = 1) -> int:
        """The prompt tokens a forward may carry to last about ``seconds`` beside ``decoding`` rows at the
        measured speed: within ``least`` and ``most`` (``most`` while nothing is measured, or with no
        target: ``target_s`` or ``seconds`` 0)."""
        per_row = self.seconds_per_row()
        if self.target_s <= 0 or seconds <= 0 or per_row is None or per_row <= 0:
            return most
        return min(most, max(least, int(seconds / per_row) - decoding))


def forwarded_rows(ledger: Any) -> int:
    """Rows every forward counted by ``ledger`` (a ``PinLedger``) has carried so far: a step's share
    is the difference across it."""
    return sum(c.rows for table in (ledger.requested, ledger.inherited) for c in table.values())


def step_chunk(budget: int, prompts: int, prefill_step: int) -> int:
    """The tokens each of the wave's ``prompts`` prefills in a step whose budget is ``budget``: an
    equal share, at least one token, at most ``prefill_step``."""
    return max(1, min(prefill_step, budget // max(prompts, 1)))
