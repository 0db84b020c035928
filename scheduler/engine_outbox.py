"""The engine process's side of the event pipe: one message per batch of engine events, with the
engine's stats snapshot when it may have changed.

The engine thread hands over a step's events between its steps, so what building and writing the message
costs it lands between every two steps: on the H100 host (8B synth) ~65 µs a step at B = 1, where a step
is the host's own work (the engine thread's CPU 95-98 % of the step's wall), and ~250 µs at B = 128.
``MLX_BATCHD_EMIT_THREAD=1`` has a writer thread build and write the messages instead (vLLM v1's engine
core sends its outputs from a thread of its own), the engine thread only queueing each batch; MLX lets
go of the GIL while it evaluates a step, so the writer's Python can run during the engine thread's own
work. Measured on the H100 (b1_timeline, 128 tokens, daemons alternating on one lease,
docs/benchmarks.md section 38): the engine thread's hand-overs fell from 7-9 to 1.8 ms a request at
B = 1 and from 27-30 to 3 ms at B = 128, but the wall outside the steps did not (B = 1 16.8-19.8 ms with
the writer, 15.6-20.4 without; B = 128 142-195 against 122-150), and a B = 128 request group took 4,977
ms (median of 3) against 4,903 and 4,918 (the writer's Python needs the GIL, which the engine thread
holds while it builds its next graph: a likely cause, not measured). On the development CPU (demo model,
64 tokens, six daemons alternating) a B = 1 request took 571 / 571 / 521 ms without it and 501 / 581 /
565 with it, B = 4 985 / 1007 / 986 against 995 / 1019 / 994. So the engine thread writes by default,
and the writer thread is an operator's choice. Either way the messages go out in the order their events
were made.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from queue import Queue
from typing import Any

from scheduler.event_pipe import PipeWriter
from workers.backend import env_switch
from workers.engine import Finished
from workers.loop import EngineThread, Ready, Signal

log = logging.getLogger("mlx_batchd")

#: How often the child sends a changed snapshot while no events carry one (probe progress).
SNAPSHOT_POLL_S = 0.1
#: Events carry the snapshot at most this often, and always when a sequence finished or the engine
#: became ready. Building and packing one costs the engine thread 12-50 us on the development CPU,
#: and on the H200 host 12-17 of a request's 130 hand-overs (one in three with a snapshot) took over
#: 0.2 ms, next to ~7 ms B = 1 steps: so not every step. A stats reader sees counters at most this
#: old while sequences run, and current ones after any end.
SNAPSHOT_EVERY_S = 0.1
#: Batches of events the writer may be behind before the engine thread waits for it: with the pipe's
#: own buffer, what bounds an engine's lead over a front end that stopped reading (as a full pipe
#: does when the engine thread writes itself).
QUEUE_BATCHES = 64
#: Unset or ``0``: events are built and written by the engine thread; ``1``: by a writer thread (see above).
EMIT_THREAD_ENV = "MLX_BATCHD_EMIT_THREAD"


def emit_thread_wanted() -> bool:
    """The switch, read by the daemon before it starts its engine process: a value other than 0 or 1
    is an operator's typo, refused in one line (``SettingError``) like the other ``MLX_BATCHD_*``."""
    return env_switch(EMIT_THREAD_ENV) is True


class Outbox:
    """The child's event pipe, shared by the engine thread (events) and the main thread (snapshots
    while nothing else is sent)."""

    def __init__(
        self,
        pipe: PipeWriter,
        engine: Callable[[], EngineThread],
        to_wire: Callable[[list[Signal]], list[dict[str, Any]]],
        threaded: bool = False,
    ) -> None:
        """``to_wire``: a batch of events as wire maps (``engine_process.signals_to_wire``, kept beside
        its inverse, which the parent reads with)."""
        self._to_wire = to_wire
        self._pipe = pipe
        self._engine = engine
        self._lock = threading.Lock()
        self._sent_at = 0.0
        self._last: dict[str, Any] = {}
        self._queue: Queue[list[Signal] | None] | None = None
        self._writer: threading.Thread | None = None
        if threaded:
            log.info("engine events are written by a writer thread (%s=1)", EMIT_THREAD_ENV)
            self._queue = Queue(maxsize=QUEUE_BATCHES)
            self._writer = threading.Thread(target=self._write_queued, name="mlx-batchd-events", daemon=True)
            self._writer.start()

    def events(self, signals: list[Signal]) -> None:
        """Hand over a batch of events: written now, or queued for the writer thread (waiting while
        ``QUEUE_BATCHES`` are queued)."""
        if self._queue is not None:
            self._queue.put(signals)
        else:
            self._write(signals)

    def snapshot_if_changed(self) -> None:
        """A changed snapshot, unless one went out within ``SNAPSHOT_POLL_S`` (with events: while
        sequences run, the events carry one often enough and this would build and send a second)."""
        if time.monotonic() - self._sent_at < SNAPSHOT_POLL_S:
            return
        snap = self._engine().snapshot()
        if snap and snap != self._last:
            self._send({"events": [], "snapshot": snap})

    def close(self) -> None:
        """Every queued batch written (the engine's final signal among them); then nothing more."""
        if self._queue is not None and self._writer is not None:
            self._queue.put(None)
            self._writer.join()

    def _write(self, signals: list[Signal]) -> None:
        msg: dict[str, Any] = {"events": self._to_wire(signals)}
        now = time.monotonic()
        if now - self._sent_at >= SNAPSHOT_EVERY_S or any(isinstance(s, (Finished, Ready)) for s in signals):
            snap = self._engine().snapshot()
            if snap:
                msg["snapshot"] = snap
        self._send(msg)

    def _write_queued(self) -> None:
        assert self._queue is not None
        while (signals := self._queue.get()) is not None:
            try:
                self._write(signals)
            except Exception:
                # Events lost here would leave their requests waiting for good: end the process, which
                # the daemon reports as a dead engine (its pipe ends without a final word).
                log.exception("the engine process could not write its events; exiting")
                os._exit(1)

    def _send(self, msg: dict[str, Any]) -> None:
        with self._lock:
            if "snapshot" in msg:
                self._sent_at, self._last = time.monotonic(), msg["snapshot"]
            self._pipe.send(msg)  # False once the parent is gone: nobody to tell
