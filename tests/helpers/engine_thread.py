"""A real ``EngineThread`` on a model directory, its signals collected in a queue, for tests that
drive the engine loop the way the daemon does (commands in, signals out) without a front end."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

from workers.api import EngineSettings, Finished, Ready, Signal, Tokens
from workers.engine.loop import EngineThread
from workers.models.loading import load as load_model


class EngineThreadRun:
    """A real ``EngineThread`` on the tiny model, its signals collected in a queue."""

    def __init__(self, model: Path, **settings: Any) -> None:
        self.out: queue.SimpleQueue[Signal] = queue.SimpleQueue()
        self.engine = EngineThread(lambda: load_model(str(model)), self._emit, EngineSettings(**settings))

    def _emit(self, signals: list[Signal]) -> None:
        for s in signals:
            self.out.put(s)

    def next(self) -> Signal:
        return self.out.get(timeout=30)

    def until_finished(self, seq: int) -> list[int]:
        """Wait for ``seq``'s end; return the tokens of every sequence seen on the way, in order."""
        tokens: list[int] = []
        while not (isinstance(signal := self.next(), Finished) and signal.seq == seq):
            if isinstance(signal, Tokens):
                tokens += signal.tokens
        return tokens

    def __enter__(self) -> EngineThreadRun:
        self.engine.start()
        assert isinstance(self.next(), Ready)
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.shutdown()
        self.engine.join(30)
        assert not self.engine.is_alive()
