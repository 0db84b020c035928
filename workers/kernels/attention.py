"""Per-query attention: a block's attention computed as decode computes it, query by query.

At the per-query levels (``Level.per_query``) each query of a block attends with decode's
single-query, mask-free call over exactly the view decode would have got (``per_query_sdpa``, patched
over mlx-lm's ``scaled_dot_product_attention`` by ``patches.install``). The views come from the real
cache's own update path (``PerQueryCache``): a growing ``KVCache`` with room for the block takes it
in one update, and each query's view is a prefix of the one that update returns (same buffer, same
strides as after its own one-token update); any other cache (rotating, quantized, or one due to grow)
and every cache at ``per-query-1`` takes T one-token updates. The cache's physical order and memory
layout are decode's by construction, rotating caches included.

Consecutive queries may share one call (``group_width``) where that is measured to give each query
decode's bytes: first the project's kernel (``sdpa_rows``: MLX CUDA's vector attention kernel with
each query over its own key count, where decode ran that kernel), then MLX's own causal call (on
backends whose multi-query kernel walks each query's keys as decode does; MLX CUDA sends several
queries to cuDNN instead). One call per group instead of one per query cuts a verify block's
attention launches and graph building. Whether it holds is measured per backend and shape on random
data at first use (``_measure``), through the divergence seam like every other call, and the probe
then checks the level end to end; where it does not hold, and always at ``per-query-1``, one query
per call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import mlx.core as mx

from workers.api import Level
from workers.kernels import batch_attention, fastpath, sdpa_rows, seam
from workers.kernels.levels import current_level

log = logging.getLogger("mlx_batchd.attention")

#: Most queries one grouped call may take (a verify block is at most 9 queries wide).
MAX_GROUP = 8
#: A group never spans a multiple of this many keys (decode's key counts on both sides of one), and
#: a query whose decode saw exactly such a multiple attends alone: attention kernels change strategy
#: at key counts like these (MLX CUDA goes from one pass to two above 1,024 keys), and a query must
#: be computed by the strategy its decode step used.
SPLIT = 1024
#: Key counts (of the block's last query) the measurement checks a width at: short, past a strategy
#: change, across one.
_CHECK_ENDS = (MAX_GROUP + 2, 300, 2 * 256 + 4, SPLIT + 3, 4 * SPLIT + 3)

#: Measured widths by (query heads, KV heads, head dim, dtype, scale, seam).
_widths: dict[tuple[Any, ...], tuple[int, bool]] = {}


class Views:
    """Each block query's K/V as decode had it, by query: kept from one-token updates (``pairs``), or
    sliced, only when asked for, from the view one whole-block update returned (``block``)."""

    def __init__(self, lengths: list[int], at: Callable[[int], tuple[mx.array, mx.array]], prefixes: bool) -> None:
        self.lengths = lengths
        self.at = at
        #: Whether every query's view is a prefix of the last one's (one key more per query).
        self.prefixes = prefixes

    @classmethod
    def pairs(cls, views: list[tuple[mx.array, mx.array]]) -> Views:
        lengths = [k.shape[2] if isinstance(k, mx.array) else -1 for k, _ in views]
        prefixes = lengths[0] >= 0 and all(n == lengths[0] + i for i, n in enumerate(lengths))
        return cls(lengths, views.__getitem__, prefixes)

    @classmethod
    def block(cls, keys: mx.array, values: mx.array, t: int) -> Views:
        n = keys.shape[2]
        lengths = [n - t + 1 + i for i in range(t)]

        def at(i: int) -> tuple[mx.array, mx.array]:
            return (keys, values) if i == t - 1 else (keys[:, :, : lengths[i]], values[:, :, : lengths[i]])

        return cls(lengths, at, True)


def _whole_block(cache: Any, t: int) -> bool:
    """Whether a T-token update may be one update: a growing ``KVCache`` (not rotating, not
    quantized) whose buffer holds the T keys without growing, so each query's view is a prefix, in
    the same buffer with the same strides, of what T one-token updates would have returned; and not
    at ``per-query-1``, which makes decode's own one-token updates by construction."""
    from mlx_lm.models.cache import KVCache

    return (
        type(cache) is KVCache
        and cache.keys is not None
        and cache.offset + t <= cache.keys.shape[2]
        and current_level() is not Level.PER_QUERY_1
    )


class PerQueryCache:
    """A cache proxy for a per-query forward: each query of a T-token update gets decode's view.

    A growing cache with room for the block takes the T tokens in one update and each query's view
    is a prefix of the one it returns (``_whole_block``); any other cache is updated T times with one
    token, through its own ``update_and_fetch`` exactly as decode does, and the view each update
    returns (decode's view: same buffer, same order, same strides) is kept for that query's attention.
    Everything else is delegated to the real cache.
    """

    def __init__(self, cache: Any) -> None:
        self.__dict__["_cache"] = cache
        self.__dict__["views"] = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        cache = self._cache
        t = keys.shape[2]
        if t == 1:
            self.__dict__["views"] = None
            return cache.update_and_fetch(keys, values)
        if _whole_block(cache, t):
            k, v = cache.update_and_fetch(keys, values)
            k, v = mx.array(k), mx.array(v)
            self.__dict__["views"] = Views.block(k, v, t)
            return k, v
        pairs = []
        for i in range(t):
            k, v = cache.update_and_fetch(keys[:, :, i : i + 1], values[:, :, i : i + 1])
            # A cache may hand back its buffer object itself, which the next update mutates in
            # place; ``mx.array`` takes a handle to the current value (no copy, same layout).
            pairs.append((mx.array(k), mx.array(v)))
        self.__dict__["views"] = Views.pairs(pairs)
        return pairs[-1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cache, name, value)


def wrap_caches(cache: list[Any] | None) -> list[Any] | None:
    """Per-query proxies for a single-sequence forward's caches."""
    if cache is None:
        return None
    return [c if c is None or isinstance(c, PerQueryCache) else PerQueryCache(c) for c in cache]


def spans(lengths: list[int], width: int, alone_every: int | None = None) -> list[tuple[int, int]]:
    """Consecutive queries in groups of at most ``width``, given each query's decode key count
    (``lengths``, one more per query): [first, last] index pairs, no group spanning a ``SPLIT``
    multiple and such a multiple alone (and a multiple of ``alone_every`` alone, when given). Runs
    for every attention call of a verify block: the per-query facts are computed in list
    comprehensions, not per-query function calls."""
    sides = [(n // SPLIT, (n - 1) // SPLIT) for n in lengths]
    alone = [alone_every is not None and n % alone_every == 0 for n in lengths]
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or i - start == width or sides[i] != sides[start] or alone[i] or alone[start]:
            out.append((start, i - 1))
            start = i
    return out


def _grouped(
    original: Callable[..., mx.array],
    queries: mx.array,
    views: Views,
    cache: Any,
    scale: float,
    width: int,
    kwargs: dict[str, Any],
    kernel: bool = False,
) -> mx.array:
    """The block's attention, one call per group of queries over the view after its last query's
    update: through the project's kernel (``kernel``, ``sdpa_rows``: each query over its own keys) or
    MLX's causal call; a one-query group is decode's own mask-free call."""
    outs = []
    for first, last in spans(views.lengths, width, sdpa_rows.ALONE_EVERY if kernel else None):
        q = queries[:, :, first : last + 1]
        n = last - first + 1
        if n > 1 and kernel:  # reads the view where it lies (no contiguous copy)
            out = sdpa_rows.attend(q, *views.at(last), scale)
        else:
            k, v = fastpath.attention_inputs(*views.at(last))
            out = original(q, k, v, cache, scale=scale, mask="causal" if n > 1 else None, **kwargs)
        outs.append(seam.apply("attention", out, n, None, q))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _measure(original: Callable[..., mx.array], queries: mx.array, keys: mx.array, scale: float) -> tuple[int, bool]:
    """The widest group (``MAX_GROUP`` down to 2) whose calls give every query, at each of
    ``_CHECK_ENDS``, the bytes of its own one-query call on random data of the block's shapes, and
    whether the project's kernel gives it (tried first, where it takes the shapes; then MLX's causal
    calls); (1, False) when neither does."""
    heads, kv_heads, dim = queries.shape[1], keys.shape[1], queries.shape[3]
    t = MAX_GROUP + 1
    kernel_takes = sdpa_rows.takes(queries, keys, keys)
    for kernel in (True, False) if kernel_takes else (False,):
        for width in range(MAX_GROUP, 1, -1):
            if _holds(original, heads, kv_heads, dim, queries.dtype, keys.dtype, scale, t, width, kernel):
                return width, kernel
    return 1, False


def _holds(
    original: Callable[..., mx.array],
    heads: int,
    kv_heads: int,
    dim: int,
    q_dtype: Any,
    kv_dtype: Any,
    scale: float,
    t: int,
    width: int,
    kernel: bool,
) -> bool:
    for end in _CHECK_ENDS:
        key = mx.random.key(end * 31 + width)
        q = mx.random.normal((1, heads, t, dim), key=key).astype(q_dtype)
        k = mx.random.normal((1, kv_heads, end, dim), key=mx.random.key(end + 1)).astype(kv_dtype)
        v = mx.random.normal((1, kv_heads, end, dim), key=mx.random.key(end + 2)).astype(kv_dtype)
        views = Views.pairs([(k[:, :, : end - t + 1 + i], v[:, :, : end - t + 1 + i]) for i in range(t)])
        try:
            grouped = _grouped(original, q, views, None, scale, width, {}, kernel)
            alone = _grouped(original, q, views, None, scale, 1, {})
            mx.eval(grouped, alone)
        except Exception:  # a kernel that does not build or launch here is not used
            if not kernel:
                raise
            log.warning("per-query attention: the project's kernel failed on this shape", exc_info=True)
            return False
        if not bool(mx.array_equal(grouped.view(mx.uint8), alone.view(mx.uint8)).item()):
            return False
    return True


def group_width(original: Callable[..., mx.array], queries: mx.array, keys: mx.array, scale: float) -> tuple[int, bool]:
    """Queries per attention call at the per-query levels for this shape, and whether through the
    project's kernel (measured once per process and shape, and again whenever the divergence seam
    changes)."""
    key = (queries.shape[1], keys.shape[1], queries.shape[3], str(queries.dtype), scale, seam.divergence_seam)
    found = _widths.get(key)
    if found is None:
        found = _widths[key] = _measure(original, queries, keys, scale)
        how = "the project's kernel" if found[1] else "MLX's calls"
        log.info("per-query attention on %s: %d queries per call (%s)", key[:4], found[0], how)
    return found


def _growing(cache: Any, views: Views) -> bool:
    """Whether every query's view is a prefix of the last one's in a growing ``KVCache`` (not a
    rotating or a quantized one), so one call over the last view can serve them all."""
    from mlx_lm.models.cache import KVCache

    return isinstance(cache, KVCache) and views.prefixes


#: Set while ``compiled_layers`` traces a layer half: the attention call is handed to it (with the entry
#: point itself first) instead of attending, so the trace can stop at it or stand in for its result.
stop_at: ContextVar[Callable[..., Any] | None] = ContextVar("mlx_batchd_stop_at", default=None)


def per_query_sdpa(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """Wrap one model module's attention entry point: a forward through ``PerQueryCache`` attends
    query by query (in measured groups) over the views its updates returned; any other goes
    straight through."""

    def sdpa(
        queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any, **kwargs: Any
    ) -> mx.array:
        stop = stop_at.get()
        if stop is not None:
            return stop(sdpa, queries, keys, values, scale=scale, cache=cache, mask=mask, **kwargs)
        views = cache.views if isinstance(cache, PerQueryCache) else None
        if views is None:
            keys, values = fastpath.attention_inputs(keys, values)
            if not hasattr(cache, "bits") and batch_attention.takes(queries, keys, values, mask, kwargs):
                out = batch_attention.attend(queries, keys, values, mask, scale)
            else:
                out = original(queries, keys, values, cache, scale=scale, mask=mask, **kwargs)
            return seam.apply("attention", out, queries.shape[2], None, queries, mask)
        real = cache._cache
        width, kernel = 1, False
        # ``per-query-1``, the last rung before "declined", stays exact by construction: one call per query.
        if len(views.lengths) > 1 and not kwargs and current_level() is not Level.PER_QUERY_1 and _growing(real, views):
            width, kernel = group_width(original, queries, views.at(0)[0], scale)
        return _grouped(original, queries, views, real, scale, width, kwargs, kernel)

    sdpa.__wrapped__ = original  # type: ignore[attr-defined]
    return sdpa
