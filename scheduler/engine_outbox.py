"""The engine process's side of the event pipe: one message per batch of engine events, with the
engine's stats snapshot when it may have changed.

The engine thread builds and writes each step's message itself, between its steps, so the messages go
out in the order their events were made. A writer thread of its own (vLLM v1's way) was measured and
did not shorten requests: its Python needs the GIL the engine thread holds while it builds a graph.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scheduler.event_pipe import PipeWriter
from workers.api import Finished, Ready, Signal

if TYPE_CHECKING:
    from workers.engine.loop import EngineThread

#: How often the child sends a changed snapshot while no events carry one (probe progress).
SNAPSHOT_POLL_S = 0.1
#: Events carry the snapshot at most this often, and always when a sequence finished or the engine
#: became ready. Building and packing one is a visible share of a hand-over on a slow host, so not
#: every step. A stats reader sees counters at most this old while sequences run, and current ones
#: after any end.
SNAPSHOT_EVERY_S = 0.1


class Outbox:
    """The child's event pipe, shared by the engine thread (events) and the main thread (snapshots
    while nothing else is sent)."""

    def __init__(
        self,
        pipe: PipeWriter,
        engine: Callable[[], EngineThread],
        to_wire: Callable[[list[Signal]], list[dict[str, Any]]],
    ) -> None:
        """``to_wire``: a batch of events as wire maps (``workers.api.to_wire``)."""
        self._to_wire = to_wire
        self._pipe = pipe
        self._engine = engine
        self._lock = threading.Lock()
        self._sent_at = 0.0
        self._last: dict[str, Any] = {}

    def events(self, signals: list[Signal]) -> None:
        """Hand over a batch of events: written now."""
        self._write(signals)

    def snapshot_if_changed(self) -> None:
        """A changed snapshot, unless one went out within ``SNAPSHOT_POLL_S`` (with events: while
        sequences run, the events carry one often enough and this would build and send a second)."""
        if time.monotonic() - self._sent_at < SNAPSHOT_POLL_S:
            return
        snap = self._engine().snapshot()
        if snap and snap != self._last:
            self._send({"events": [], "snapshot": snap})

    def _write(self, signals: list[Signal]) -> None:
        msg: dict[str, Any] = {"events": self._to_wire(signals)}
        now = time.monotonic()
        if now - self._sent_at >= SNAPSHOT_EVERY_S or any(isinstance(s, (Finished, Ready)) for s in signals):
            snap = self._engine().snapshot()
            if snap:
                msg["snapshot"] = snap
        self._send(msg)

    def _send(self, msg: dict[str, Any]) -> None:
        with self._lock:
            if "snapshot" in msg:
                self._sent_at, self._last = time.monotonic(), msg["snapshot"]
            self._pipe.send(msg)  # False once the parent is gone: nobody to tell
