"""Where an engine's seconds before ``Ready`` went, phase by phase (set-up, reading the weights, the
width measurement, the warm-up, ...): logged at ``Ready`` and kept in the engine's stats
(``ready_phases``), so a slow start names the phase that made it slow."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.models import LoadedModel


class PhaseClock:
    """Seconds by phase, in the order the phases first ran; a phase run twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - tic)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = round(self.seconds.get(name, 0.0) + seconds, 3)

    def total(self) -> float:
        """Seconds since the clock was made."""
        return time.perf_counter() - self._start

    def line(self) -> str:
        """``ready in 71.2 s: set-up 0.4 s, weights 12.0 s, ...``."""
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())
        return f"ready in {self.total():.1f} s: {parts}"


def timed_load(clock: PhaseClock, load: Callable[[], LoadedModel]) -> LoadedModel:
    """``load()``, its seconds on ``clock`` by the phases it reports (``LoadedModel.phases``) and the
    rest as ``load (other)``; all of it as ``load`` where it reports none."""
    tic = time.perf_counter()
    loaded = load()
    spent = time.perf_counter() - tic
    if not loaded.phases:
        clock.add("load", spent)
        return loaded
    for name, seconds in loaded.phases.items():
        clock.add(name, seconds)
    clock.add("load (other)", max(0.0, spent - sum(loaded.phases.values())))
    return loaded
