"""The daemon's watchdog on its engine process: work pending and no word from the engine for too long.

An engine that stops making progress without dying (a hung kernel, a deadlock, a stopped process)
closes no pipe and raises nothing: without a watchdog its requests wait for good and ``health``
keeps saying ``ready``. The parent's side of the engine process sees every command it sends and
every message that comes back, so it knows, without asking the engine:

- **work pending**: sequences handed to the engine and not finished, except paused ones (a
  back-pressured sequence is parked out of the batch, with no step to run for it; once cancelled it
  is owed an end again), and a shutdown asked for and not answered;
- **progress**: any message of events from the engine process (every engine step sends one, with
  its ``StepInfo``; a bare snapshot from its main thread is not the engine's), and also words written
  but not read yet (the front end is behind, not the engine).

Past ``timeout_s`` of pending work without progress, measured from the later of the last message and
the moment work became pending (an idle engine sends nothing, and a start-up before ``ready`` is
never watched), the watchdog calls ``on_hung`` once, from its own thread. The limit stretches to
``STEP_MARGIN`` times the longest step the engine has reported, so a machine whose steps
legitimately come near the limit (a long prefill chunk on a slow CPU) is not declared dead for the
next one. The first long step is kept short instead: the engine sizes its prefill steps to run within
``STEP_TARGET_SHARE`` of the limit at the speed it measured (from its warm-up on).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

#: Seconds of pending work without a word from the engine before it is presumed hung (``engine_timeout``).
ENGINE_TIMEOUT_S = 60.0
#: The limit is at least this many times the longest step the engine reported.
STEP_MARGIN = 2.0
#: The engine sizes its prefill steps to run within this share of ``timeout_s`` at its measured speed
#: (``workers.engine.prefill_pace``): a slow machine's long prompts take more, shorter steps, each
#: reported in time, rather than one step the watchdog would take for a hang.
STEP_TARGET_SHARE = 0.25


class _State(Enum):
    RUNNING = "running"
    PAUSED = "paused"
    CANCELLED = "cancelled"


class Watchdog:
    """Watches one engine process (see the module's docstring). Every method is thread-safe."""

    def __init__(
        self,
        timeout_s: float,
        on_hung: Callable[[str], None],
        words_waiting: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``words_waiting``: whether the engine has written something the front end has not read."""
        self.timeout_s = timeout_s
        self._clock = clock
        self._on_hung = on_hung
        self._words_waiting = words_waiting
        self._lock = threading.Lock()
        self._seqs: dict[int, _State] = {}
        #: Sequences that owe progress (not paused), and whether a shutdown is owed its answer.
        self._owing = 0
        self._stopping = False
        self._armed = False
        self._since = self._clock()
        self._longest_step = 0.0
        self._closed = threading.Event()
        #: Set once ``on_hung`` was called.
        self.fired = False

    def start(self) -> None:
        """Start watching; with ``timeout_s`` 0 (``engine_timeout = 0``) nothing is watched."""
        if self.timeout_s <= 0:
            return
        threading.Thread(target=self._run, name="mlx-batchd-engine-watchdog", daemon=True).start()

    def close(self) -> None:
        """Watch no more (the engine said its last word, or is being joined)."""
        self._closed.set()

    # ------------------------------------------------------------------ what the engine was asked

    def ready(self) -> None:
        """The engine is serving: from now on pending work is watched."""
        with self._lock:
            self._armed = True
            self._since = self._clock()

    def submitted(self, seq: int) -> None:
        with self._lock:
            if self._seqs.get(seq) in (None, _State.PAUSED):  # one handed over twice counts once
                self._owe()
            self._seqs[seq] = _State.RUNNING

    def paused(self, seq: int) -> None:
        with self._lock:
            if self._seqs.get(seq) is _State.RUNNING:
                self._seqs[seq] = _State.PAUSED
                self._owing -= 1

    def resumed(self, seq: int) -> None:
        with self._lock:
            if self._seqs.get(seq) is _State.PAUSED:
                self._owe()
                self._seqs[seq] = _State.RUNNING

    def cancelled(self, seq: int) -> None:
        """A cancelled sequence is owed its end, paused or not."""
        with self._lock:
            state = self._seqs.get(seq)
            if state is None:
                return
            if state is _State.PAUSED:
                self._owe()
            self._seqs[seq] = _State.CANCELLED

    def stopping(self) -> None:
        """A shutdown was sent: the engine owes its final word."""
        with self._lock:
            if not self._stopping:
                self._clock_from_now()
                self._stopping = True

    def _owe(self) -> None:
        """One more sequence owes progress (under the lock)."""
        self._clock_from_now()
        self._owing += 1

    def _clock_from_now(self) -> None:
        """Before work is added (under the lock): an engine that owed nothing starts its clock now."""
        if not self._owes():
            self._since = self._clock()

    # ------------------------------------------------------------------ what came back

    def heard(self, events: list[dict[str, Any]]) -> None:
        """A message from the engine process (its wire events): progress, ends, step times. A message
        without events (a snapshot the engine process's main thread sent while the engine thread said
        nothing) is no progress of the engine."""
        if not events:
            return
        now = self._clock()
        with self._lock:
            self._since = now
            for d in events:
                kind = d.get("t")
                if kind == "finished":
                    state = self._seqs.pop(d["seq"], None)
                    if state is not None and state is not _State.PAUSED:
                        self._owing -= 1
                elif kind == "step":
                    self._longest_step = max(self._longest_step, float(d["seconds"]))

    def _owes(self) -> bool:
        return self._stopping or self._owing > 0

    # ------------------------------------------------------------------ the check

    def limit_s(self) -> float:
        """The silence allowed with work pending now (``timeout_s``, stretched by the longest step)."""
        with self._lock:
            return max(self.timeout_s, STEP_MARGIN * self._longest_step)

    def overdue(self, now: float) -> str | None:
        """Why the engine is presumed hung at ``now``, or ``None``."""
        limit = self.limit_s()
        with self._lock:
            if not self._armed or not self._owes() or self._closed.is_set():
                return None
            quiet = now - self._since
            owed = self._owing
        if quiet <= limit:
            return None
        if self._words_waiting():  # the engine spoke; the front end has not read it yet
            with self._lock:
                self._since = max(self._since, now)
            return None
        what = f"{owed} sequence{'s' if owed != 1 else ''}" if owed else "a shutdown"
        return (
            f"the engine made no progress for {quiet:.0f} s with work pending ({what}); limit "
            f"{limit:g} s (engine_timeout = {self.timeout_s:g} in the config file): presumed hung"
        )

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._closed.wait(period):
            why = self.overdue(self._clock())
            if why is not None:
                self.fired = True
                self._on_hung(why)
                return
