"""Cache layout: one buffer layout for a single sequence's KV caches through a draw or a burst.

mlx-lm grows ``KVCache`` in steps of 256 tokens, and each growth re-allocates the buffer, so the
views a chain and a block attend over change layout at different moments. Giving the caches a
larger step keeps the layout fixed between growths.
"""

from __future__ import annotations

import functools
from typing import Any

#: KV capacity growth, in tokens, of the single-sequence caches the probe and bursts use (mlx-lm
#: grows ``KVCache`` in steps of 256). Each growth re-allocates the buffer, so the views a chain and
#: a block attend over change layout at different moments; with this step a sequence's views keep
#: one layout until its context crosses a multiple of 4,096 tokens. The price is memory: every
#: single-sequence cache holds at least 4,096 positions. Batched caches keep mlx-lm's step.
LAYOUT_STEP = 4096


def stabilize_layout(cache: list[Any] | None) -> None:
    """Give a single sequence's KV caches a growth step of ``LAYOUT_STEP`` tokens, so the chain's
    and the block's views keep one layout through a draw or a burst (mlx-lm's caches read
    ``self.step``; an instance attribute overrides the class's 256). Rotating caches and batched
    caches are left as they are."""
    if cache is None:
        return
    growing = _growing_cache_types()
    for c in cache:
        if isinstance(c, growing) and c.step != LAYOUT_STEP:  # type: ignore[attr-defined]
            c.step = LAYOUT_STEP  # type: ignore[attr-defined]


@functools.cache
def _growing_cache_types() -> tuple[type, ...]:
    """mlx-lm's single-sequence caches that grow by ``step`` (imported on first use: mlx-lm is slow to import)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    return (KVCache, QuantizedKVCache)
