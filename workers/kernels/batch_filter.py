"""Dropping finished sequences from a batch with one host round trip instead of one per layer.

When a sequence of the decode batch finishes (or a prefilling one is cancelled), mlx-lm's
``GenerationBatch.filter`` (and ``PromptProcessingBatch.filter``) calls ``filter`` on every layer's
cache, and each ``BatchKVCache`` layer reads its kept sequences' left padding back to the host
(``min(left_padding.tolist())``) to trim the padding they all share: one device round trip per
layer, each queued behind the step already in flight: on a GPU, about a decode step's own time
for every step in which a sequence finished. The daemon, whose requests arrive spread over several
steps, finishes them over several steps too, and paid it several times per batch.

``filtered`` gathers every ``BatchKVCache`` layer's kept padding and evaluates them together (one
round trip); each layer's own ``filter`` then indexes a stand-in (``_Gathered``) that hands it that
evaluated padding, so mlx-lm's trimming code runs unchanged and reads the host copy at once. The
result is the same arrays mlx-lm computes (``tests/engine/test_batch_filter.py`` compares them);
``patches.install`` puts it on both batch classes and ``patches.stock`` takes it off with the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx


class _Gathered:
    """A layer's ``left_padding`` during one ``filter(keep)`` call: indexing it with that very
    ``keep`` list gives the padding already gathered and evaluated; any other use goes to the
    original array (so a change in mlx-lm's ``filter`` costs the round trip, not correctness)."""

    def __init__(self, original: mx.array, keep: list[int], kept: mx.array) -> None:
        self.original, self.keep, self.kept = original, keep, kept

    def __getitem__(self, index: Any) -> mx.array:
        return self.kept if index is self.keep else self.original[index]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


def filtered(original: Callable[[Any, list[int]], None]) -> Callable[[Any, list[int]], None]:
    """Wrap a batch's ``filter(keep)``: the kept left padding of every ``BatchKVCache`` layer is
    evaluated in one go before mlx-lm filters the layers one by one."""
    from mlx_lm.models.cache import BatchKVCache

    def filter(self: Any, keep: list[int]) -> None:
        layers = [c for c in getattr(self, "prompt_cache", ()) if type(c) is BatchKVCache] if keep else []
        if not layers:
            original(self, keep)
            return
        kept = [c.left_padding[keep] for c in layers]
        mx.eval(kept)
        stand_ins = []
        for c, k in zip(layers, kept):
            stand_ins.append(_Gathered(c.left_padding, keep, k))
            c.left_padding = stand_ins[-1]  # type: ignore[assignment]  # for this one filter call
        try:
            original(self, keep)
        finally:
            for c, s in zip(layers, stand_ins):
                if c.left_padding is s:  # a layer the call did not reach keeps its own array
                    c.left_padding = s.original

    filter.__wrapped__ = original  # type: ignore[attr-defined]
    return filter
