"""The verdict holder: the probe in progress and the verdicts it has reached, per pairing.

The engine advances a probe one draw between its steps (so serving never waits for a whole
probe); a finished probe leaves a verdict here, which the burst runner reads for its verify level
and the stats reply reads through ``summary``. Under a process-wide pin (the bench's arm) a verdict's level is
set for the whole process as soon as it is reached.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from workers.api import Level, PinScope
from workers.exact.draws import within_draw
from workers.exact.pins import unpinned
from workers.exact.probe import Verdict, failed_verdict
from workers.kernels import set_process_level

log = logging.getLogger("mlx_batchd.probe")


@dataclass
class ProbeState:
    name: str
    steps: Generator[str, None, Verdict]
    label: str = "starting"
    #: Draws started so far, and when the probe started (for its progress lines).
    step: int = 0
    started: float = field(default_factory=time.monotonic)


class Verdicts:
    """The probe state and the verdicts by pairing name."""

    def __init__(self, pin_scope: PinScope) -> None:
        self.pin_scope = pin_scope
        self.probe_state: ProbeState | None = None
        self.by_name: dict[str, Verdict] = {}

    def get(self, name: str | None) -> Verdict | None:
        """The verdict for ``name``, or ``None`` while it has none (or when there is no pairing)."""
        return None if name is None else self.by_name.get(name)

    def start_probe(self, name: str, steps: Generator[str, None, Verdict]) -> None:
        """Queue a probe; ``probe_step`` advances it one forward at a time."""
        self.probe_state = ProbeState(name, steps)

    @property
    def probing(self) -> bool:
        return self.probe_state is not None

    def probe_step(self) -> Verdict | None:
        """Advance the probe by one unit (a forward); return the verdict when it is done."""
        state = self.probe_state
        if state is None:
            return None
        try:
            with unpinned("probe"):
                state.label = next(state.steps)
            state.step += 1
            if within_draw(state.label):
                return None
            # A line per draw, so a start-up probe shows its progress instead of a silent wait.
            log.info(
                "probe %s: draw %d, %s (%.1f s so far)",
                state.name,
                state.step,
                state.label,
                time.monotonic() - state.started,
            )
            return None
        except StopIteration as done:
            verdict: Verdict = done.value
        except Exception as exc:  # a probe that fails is a declined verdict, never a crash
            verdict = failed_verdict(state.name, exc)
        log.info(
            "probe %s: done after %d draws, %s (%s)",
            state.name,
            state.step,
            "declined" if verdict.level is None else f"level {verdict.level}",
            verdict.reason,
        )
        self.probe_state = None
        self.by_name[state.name] = verdict
        if self.pin_scope == "process" and verdict.level is not None:
            set_process_level(Level(verdict.level))
        return verdict

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: {
                "level": v.level,
                "exact": v.exact,
                "reason": v.reason,
                "probe_seconds": v.probe_seconds,
                "from_cache": v.from_cache,
            }
            for name, v in self.by_name.items()
        }
        if self.probe_state is not None:
            out[self.probe_state.name] = {"status": "probing", "at": self.probe_state.label}
        return out
