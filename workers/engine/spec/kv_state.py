"""A plain KV cache's whole state, taken and put back: how a burst's guess and a draft model's own
cache are undone exactly (``workers.engine.spec.lookahead``, ``workers.engine.spec.drafters``)."""

from __future__ import annotations

from typing import Any


def save(cache: list[Any]) -> list[tuple[Any, Any, int]]:
    """Each plain ``KVCache``'s whole state, (keys, values, offset), for ``restore``."""
    return [(c.keys, c.values, c.offset) for c in cache]


def restore(cache: list[Any], saved: list[tuple[Any, Any, int]]) -> None:
    """Put back what ``save`` took (the arrays themselves, so nothing is copied)."""
    for c, (keys, values, offset) in zip(cache, saved, strict=True):
        c.keys, c.values, c.offset = keys, values, offset
