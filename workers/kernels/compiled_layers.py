"""Decode steps' layers as two compiled halves around the attention core.

At B <= 8 on MLX CUDA a decode step is set by the host, not the device: building its graph in Python
(the project's per-projection routing included) and MLX's per-op evaluation take several times what
reading the weights takes. ``mx.compile`` traces a
function once per input shape and then replays its graph from C++, fusing elementwise ops, so none of
that Python runs again. A whole layer cannot be traced once, though: its cache returns keys and
values that grow by one position a step. So each layer of a decode step runs in three parts:

- **head** (compiled): everything before attention (norm, q/k/v projections, rope at the cache's
  offset, which is an array in a batch cache, so it is an input and not a constant);
- the cache's ``update_and_fetch`` and the attention call, exactly as mlx-lm makes them;
- **tail** (compiled): everything after it (o projection, residual, MLP, residual).

Both halves are traced from mlx-lm's own layer code: the layer is called with a cache that passes
new keys and values straight back, and the attention entry point (``attention.stop_at``) hands its
arguments to the tracer instead of attending: the head returns them, the tail substitutes the real
attention output for the attention's result. What a half does not need (the tail's q/k/v, the head's
MLP) is not in its traced graph, so nothing runs twice.

Scope: decode steps (one new token per sequence) at ``wide``, classic B = 1 decode included (the
policy's ``compiled_lone``), on mlx-lm
layer classes of the families in ``FAMILIES`` (each covered by a test that compares the compiled
step's logits with the plain step's, byte for byte on the CPU), over mlx-lm's ``BatchKVCache`` (which
the engine's lone sequence decodes on too). Prefill, verify blocks and every
pinned level run mlx-lm's code unchanged. Classic B = 1 decode is the chain bursts must reproduce: the
probe measures it as it runs (through the engine's model) and its verdicts are keyed by whether it is
compiled (``lone``). A layer's halves are traced at a batch size only after one plain step at that size (the
project's kernels check themselves at first use, which evaluates), and traced again whenever the
kernel plans or the fast-path policy change (both are read while tracing).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from workers.api import Level
from workers.kernels import attention, fastpath, seam
from workers.kernels.levels import current_level

log = logging.getLogger("mlx_batchd")

#: mlx-lm model modules whose decoder layers call attention as llama's does: one ``update_and_fetch``
#: of the rope'd keys and values, its result passed to ``scaled_dot_product_attention``, the mask used
#: only there.
FAMILIES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")

#: False inside ``patches.stock`` (the raw peer in benchmarks runs mlx-lm's code).
enabled = True
#: Layer classes whose ``__call__`` is wrapped (class -> its own ``__call__``).
_patched: dict[type, Callable[..., Any]] = {}
#: id(layer) -> its halves, for the layers ``install`` registered.
_layers: dict[int, _Halves] = {}
_lock = threading.Lock()


class _PassThrough:
    """Stands in for a layer's cache while a half is traced: the offset it is given, and new keys
    and values handed straight back (the real cache takes them between the halves)."""

    def __init__(self, offset: mx.array) -> None:
        self.offset = offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values


@dataclass
class _Attend:
    """The attention call the head's trace stopped at: the model module's entry point and its
    arguments other than the arrays, the cache and the mask (constants of the layer)."""

    fn: Callable[..., mx.array]
    scale: float
    kwargs: dict[str, Any]


@dataclass
class _Halves:
    """One layer's compiled halves (made again when what tracing read changes: ``key``)."""

    layer: weakref.ref[Any]
    original: Callable[..., mx.array]
    key: tuple[int, Any] = (-1, None)
    head: Callable[..., Any] | None = None
    tail: Callable[..., Any] | None = None
    #: The attention call the head's trace stopped at (a one-item list the traced functions write:
    #: they hold no reference to the ``_Halves`` or the layer, so a model that goes away takes its
    #: halves and their captured weights with it).
    attend: list[_Attend] = field(default_factory=list)
    #: Batch sizes that ran one plain step since ``key`` was set.
    warm: set[int] = field(default_factory=set)
    #: Batch sizes whose halves traced (and ran) since ``key`` was set.
    done: set[int] = field(default_factory=set)

    def traced(self, b: int) -> bool:
        return b in self.done

    def build(self, key: tuple[int, Any]) -> None:
        ref, original, attend = self.layer, self.original, self.attend

        def head(x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            seen: list[mx.array] = []

            def stop(
                fn: Callable[..., mx.array], q: mx.array, k: mx.array, v: mx.array, scale: float, **kw: Any
            ) -> Any:
                kw.pop("cache", None)
                kw.pop("mask", None)
                attend[:] = [_Attend(fn, scale, kw)]
                seen.extend((q, k, v))
                return mx.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)

            _traced(ref(), original, x, offset, stop)
            return seen[0], seen[1], seen[2]

        def tail(x: mx.array, out: mx.array, offset: mx.array) -> mx.array:
            return _traced(ref(), original, x, offset, lambda *_, **__: out)

        self.key, self.warm, self.done = key, set(), set()
        self.head, self.tail = mx.compile(head), mx.compile(tail)

    def run(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        assert self.head is not None and self.tail is not None
        offset = cache.offset
        q, k, v = self.head(x, offset)
        keys, values = cache.update_and_fetch(k, v)
        attend = self.attend[0]
        out = attend.fn(q, keys, values, cache, scale=attend.scale, mask=mask, **attend.kwargs)
        return self.tail(x, out, offset)


def _traced(
    layer: Any, original: Callable[..., mx.array], x: mx.array, offset: mx.array, stop: Callable[..., Any]
) -> Any:
    """``layer``'s own forward on ``x`` with its attention call handed to ``stop``."""
    token = attention.stop_at.set(stop)
    try:
        return original(layer, x, None, cache=_PassThrough(offset))
    finally:
        attention.stop_at.reset(token)


def _batch_cache() -> type:
    from mlx_lm.models.cache import BatchKVCache

    return BatchKVCache


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    batch_cache = _batch_cache()

    def call(self: Any, x: mx.array, mask: Any = None, cache: Any = None, **kwargs: Any) -> Any:
        halves = _layers.get(id(self))
        policy = fastpath.active()
        if (
            halves is None
            or not policy.compiled_layers
            or kwargs
            or not enabled
            or type(cache) is not batch_cache
            or x.ndim != 3
            or x.shape[1] != 1
            or x.shape[0] < (1 if policy.compiled_lone else 2)
            or current_level() is not Level.WIDE
            or seam.divergence_seam is not None
            or halves.layer() is not self
        ):
            return original(self, x, mask, cache=cache, **kwargs)
        key = (fastpath.generation, policy)
        if halves.key != key:
            halves.build(key)
        b = x.shape[0]
        if b not in halves.warm:  # the kernels' first-use checks evaluate: not inside a trace
            halves.warm.add(b)
            return original(self, x, mask, cache=cache, **kwargs)
        if halves.traced(b):
            return halves.run(x, mask, cache)
        try:
            out = halves.run(x, mask, cache)
        except Exception as exc:  # fail closed: this layer keeps mlx-lm's code
            log.warning("layer %s not compiled: %s", type(self).__name__, exc)
            del _layers[id(self)]
            return original(self, x, mask, cache=cache, **kwargs)
        halves.done.add(b)
        return out

    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


def install(model: Any) -> int:
    """Run ``model``'s decoder layers of the ``FAMILIES`` as compiled halves in decode steps
    (when the fast-path policy says so); returns how many layers were registered. None where MLX's
    compilation is off (``MLX_DISABLE_COMPILE``): the halves would then run the whole layer's Python
    twice a step."""
    if os.environ.get("MLX_DISABLE_COMPILE"):
        return 0
    count = 0
    with _lock:
        for layer in getattr(model, "layers", None) or []:
            cls = type(layer)
            if cls.__module__ not in FAMILIES or not hasattr(layer, "self_attn"):
                continue
            if cls not in _patched:
                _patched[cls] = cls.__call__
                cls.__call__ = _wrap(cls.__call__)
            if id(layer) not in _layers:
                weakref.finalize(layer, _layers.pop, id(layer), None)
            _layers[id(layer)] = _Halves(weakref.ref(layer), _patched[cls])
            count += 1
    return count


def running(model: Any) -> int:
    """How many of ``model``'s layers run compiled in decode steps here (0: none; stats)."""
    if not fastpath.active().compiled_layers:
        return 0
    return sum(id(layer) in _layers for layer in getattr(model, "layers", None) or [])


def lone(model: Any) -> int:
    """How many of ``model``'s layers run compiled in classic B = 1 decode here (0: none): part of
    what a burst verdict depends on, since classic decode is the chain a verify must reproduce."""
    return running(model) if fastpath.active().compiled_lone else 0
