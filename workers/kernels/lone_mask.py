"""A batch of one sequence decodes without an attention mask, as the sequence's own cache does.

A lone sequence's classic steps run inside mlx-lm's ``BatchGenerator`` on a ``BatchKVCache`` of one
row, whose ``make_mask`` hands the model an all-true boolean mask for a one-token step; a burst's
verify, its audit and the probe's chain run on the sequence's own ``KVCache``, where the same step
has no mask. Both mean the same attention, but MLX's fused attention takes a different path with an
array mask: on MLX CUDA the two give different logit bytes and, over a long generation, different
greedy tokens (``benchmarks/lone_path_probe.py`` compares them). A verdict about the chain then
said nothing about the engine's own output: bursts passed the probe and their audits and still
changed the tokens. On the CPU the two agree, which is why no CPU test saw it.

``lone_make_mask`` returns ``None`` for a one-token step of a one-row cache whose left padding is
zero, the case where the mask is all true (mlx-lm trims a row's padding when a batch is filtered
down to it, and a cache merged from one sequence has none). The padding is read from the host once
per padding array (``make_mask`` is called on the first layer's cache once per forward), never
assumed. Every other case goes to mlx-lm's mask unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _unpadded_row(cache: Any) -> bool:
    """Whether ``cache`` holds one sequence with no left padding (memoised per padding array)."""
    keys = getattr(cache, "keys", None)
    if keys is None or keys.shape[0] != 1:
        return False
    padding = cache.left_padding
    known = getattr(cache, "_lone_padding", None)
    if known is None or known[0] is not padding:
        known = (padding, int(padding.reshape(-1)[0].item()) == 0)
        cache._lone_padding = known
    return bool(known[1])


def lone_make_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``BatchKVCache.make_mask``: ``None`` where the mask of a one-token step is all true."""

    def make_mask(self: Any, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if N == 1 and not return_array and kwargs.get("window_size") is None and _unpadded_row(self):
            return None
        return original(self, N, return_array=return_array, **kwargs)

    make_mask.__wrapped__ = original  # type: ignore[attr-defined]
    return make_mask
