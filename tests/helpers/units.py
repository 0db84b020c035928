"""Driving start-up work unit by unit in tests (the prefix check's and the probe's step generators)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import mlx.core as mx


def run_units(steps: Generator[str, None, Any], between: Callable[[], None] = lambda: None) -> tuple[list[str], Any]:
    """Each unit's label and the generator's value, calling ``between`` after every unit (as the
    engine serves between them)."""
    labels = []
    while True:
        try:
            labels.append(next(steps))
        except StopIteration as end:
            return labels, end.value
        between()


class Counted:
    """``model`` noting each forward's token count in ``events`` (``mx.eval`` notes its calls there)."""

    def __init__(self, model: Any, events: list[tuple[str, int]]) -> None:
        self.model, self.events = model, events

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, tokens: mx.array, cache: Any = None) -> mx.array:
        self.events.append(("forward", int(tokens.size)))
        return self.model(tokens, cache=cache)
