"""An engine handle's ``emit`` for tests: every signal kept in order, and an event at its last word."""

from __future__ import annotations

import threading

from workers.api import Dead, Signal, Stopped


class Recorded:
    """Pass as ``emit``: ``got`` holds the signals in order; ``final`` is set once ``Stopped`` or
    ``Dead`` came (the handle says nothing after it)."""

    def __init__(self) -> None:
        self.got: list[Signal] = []
        self.final = threading.Event()

    def __call__(self, signals: list[Signal]) -> None:
        self.got.extend(signals)
        if any(isinstance(s, (Stopped, Dead)) for s in signals):
            self.final.set()
