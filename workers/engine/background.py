"""Start-up work the engine runs between its steps, after it said ``Ready``: the kernel plans'
calibration (``plan_units.calibration_steps``) and the prefix cache's check
(``prefix_cache.check_steps``) where their results are not stored yet, and then the start of the probe.

Each piece is a generator of units (one shape's timing, one row count's forward check, one
forward of the prefix check; each yields a label of what it did); the engine loop runs one unit at a time while the engine
is idle, as it runs the probe's draws (``workers.engine.loop``), so a request that arrives waits for
one unit at most and a busy engine runs none. Pieces run in the order queued: the probe's pairing
and the prefix check's stored result name the kernel plans installed, so they follow the calibration.
Only the engine thread touches this; the stats reply reads ``summary`` from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("mlx_batchd.engine")

Steps = Generator[str, None, Any]


@dataclass
class Piece:
    """One piece of start-up work: its units (``None``: a single call, ``done(None)``), what to do
    with its result, and what each unit runs inside (``around``)."""

    name: str
    steps: Steps | None
    done: Callable[[Any], None]
    around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    status: str = "pending"
    at: str = ""
    units: int = 0
    #: Seconds its units took (the engine's time it cost) and when its first unit began.
    busy_s: float = 0.0
    started: float | None = None
    seconds: float = 0.0


@dataclass
class Background:
    """The start-up pieces still to run, in order, and the ones that ended (for the stats)."""

    queue: deque[Piece] = field(default_factory=deque)
    ended: list[Piece] = field(default_factory=list)

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def add(
        self,
        name: str,
        steps: Steps,
        done: Callable[[Any], None],
        around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        """Queue ``steps``; ``done`` gets its result once its last unit ran."""
        self.queue.append(Piece(name, steps, done, around))

    def then(self, name: str, call: Callable[[], None]) -> None:
        """``call()`` after the pieces queued so far (now, when there are none)."""
        if self.queue:
            self.queue.append(Piece(name, None, lambda _: call()))
        else:
            call()

    def step(self) -> None:
        """Run the first piece's next unit (a failed piece is logged and dropped: the engine serves
        without its result)."""
        piece = self.queue[0]
        tic = time.monotonic()
        if piece.started is None:
            piece.started = tic
            piece.status = "running"
        try:
            result: Any = None
            with piece.around():
                if piece.steps is not None:
                    try:
                        piece.at = next(piece.steps)
                    except StopIteration as end:
                        result = end.value
                    else:
                        piece.units += 1
                        return
            piece.done(result)
            piece.status = "done"
        except Exception as exc:
            log.exception("start-up work %s failed; serving without it", piece.name)
            piece.status, piece.at = "failed", repr(exc)
        finally:
            piece.busy_s += time.monotonic() - tic
        piece.seconds = time.monotonic() - piece.started
        self.queue.popleft()
        if piece.steps is not None:  # a single call's own account follows it (the probe's in the verdicts)
            self.ended.append(piece)
            log.info(
                "start-up work %s %s in %.1f s (%d units, %.1f s of them on the engine)",
                piece.name,
                piece.status,
                piece.seconds,
                piece.units,
                piece.busy_s,
            )

    def summary(self) -> dict[str, dict[str, Any]]:
        """Each piece by name: ``status`` (pending, running, done, failed), ``at`` (its last unit, or
        why it failed), ``units`` run and ``seconds`` (from its first unit to its end, once ended)."""
        pieces = [*self.ended, *self.queue]
        return {p.name: {"status": p.status, "at": p.at, "units": p.units, "seconds": p.seconds} for p in pieces}
