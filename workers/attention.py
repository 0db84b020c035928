"""Per-query attention: a block's attention computed one query at a time, as decode computes it.

At the per-query levels (``Level.per_query``) a block's T-token cache update is done as T one-token
updates through the real cache's own update path (``PerQueryCache``), and each query attends with
decode's single-query, mask-free call over exactly the view decode would have got
(``per_query_sdpa``, patched over mlx-lm's ``scaled_dot_product_attention`` by ``patches.install``).
The cache's physical order and memory layout are decode's by construction, rotating caches included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from workers import fastpath, seam


class PerQueryCache:
    """A cache proxy for a per-query forward: a T-token update is done as T one-token updates.

    Each one-token update goes through the real cache's ``update_and_fetch``, exactly as decode
    does, and the view it returns (decode's view: same buffer, same order, same strides) is kept
    for that query's attention. Everything else is delegated to the real cache.
    """

    def __init__(self, cache: Any) -> None:
        self.__dict__["_cache"] = cache
        self.__dict__["views"] = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        cache = self._cache
        if keys.shape[2] == 1:
            self.__dict__["views"] = None
            return cache.update_and_fetch(keys, values)
        views = []
        for i in range(keys.shape[2]):
            k, v = cache.update_and_fetch(keys[:, :, i : i + 1], values[:, :, i : i + 1])
            # A cache may hand back its buffer object itself, which the next update mutates in
            # place; ``mx.array`` takes a handle to the current value (no copy, same layout).
            views.append((mx.array(k), mx.array(v)))
        self.__dict__["views"] = views
        return views[-1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cache, name, value)


def wrap_caches(cache: list[Any] | None) -> list[Any] | None:
    """Per-query proxies for a single-sequence forward's caches."""
    if cache is None:
        return None
    return [c if c is None or isinstance(c, PerQueryCache) else PerQueryCache(c) for c in cache]


def per_query_sdpa(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """Wrap one model module's attention entry point: a forward through ``PerQueryCache`` attends
    one query at a time over the views its updates returned; any other goes straight through."""

    def sdpa(
        queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any, **kwargs: Any
    ) -> mx.array:
        views = cache.views if isinstance(cache, PerQueryCache) else None
        if views is None:
            keys, values = fastpath.attention_inputs(keys, values)
            out = original(queries, keys, values, cache, scale=scale, mask=mask, **kwargs)
            return seam.apply("attention", out, queries.shape[2], None, queries)
        real = cache._cache
        outs = []
        for i, (k, v) in enumerate(views):
            q = queries[:, :, i : i + 1]
            out = original(q, *fastpath.attention_inputs(k, v), real, scale=scale, mask=None, **kwargs)
            outs.append(seam.apply("attention", out, 1, None, q))
        return mx.concatenate(outs, axis=2)

    sdpa.__wrapped__ = original  # type: ignore[attr-defined]
    return sdpa
