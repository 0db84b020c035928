"""Kernel levels: buying back exactness for a verify block, scoped to that one forward.

A speculative verify runs T > 1 tokens through the target in one forward. Whether its logits are
byte-equal to T single-token decode steps depends on the backend's kernels (see FACTS.md): wide
matmuls may reduce in a different order than ``M = 1``, and multi-query masked attention differs
from decode's single-query, mask-free call, and even from it over a differently laid-out cache.

Levels, cheapest first:

- ``wide``: MLX's own dispatch.
- ``narrow``: every projection on more rows than its measured width ``W`` runs in row chunks of at
  most ``W`` (the widest chunk the backend computes row-exactly for that shape and dtype), so
  every row takes the reduction order of decode.
- ``per-query``: narrow, plus attention computed one query at a time *through the cache's own
  update path*: each of the block's tokens is written to the cache as decode would write it, and
  attends with decode's single-query, mask-free call over exactly the view decode would get. The
  cache's physical order and memory layout are decode's by construction, rotating caches included.

A level applies to the graph built while it is in force. MLX is lazy, so what matters is which
level was current when a forward *built* its graph; the engine thread builds every graph, so a
level entered with ``scoped()`` around one forward touches that forward only. ``set_process_level``
is the seed project's process-wide pin, kept only for comparison.

The projection and attention entry points of MLX and mlx-lm are patched once (``install``); at
``wide`` the patches call straight through.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from workers import fastpath


class Level(StrEnum):
    WIDE = "wide"
    NARROW = "narrow"
    PER_QUERY = "per-query"


LADDER: tuple[Level, ...] = (Level.WIDE, Level.NARROW, Level.PER_QUERY)

#: Row counts tried when measuring a projection's row-exact width.
MAX_MEASURED_WIDTH = 16

_scoped: ContextVar[Level | None] = ContextVar("mlx_batchd_scoped_level", default=None)
_process_level: Level = Level.WIDE
#: Row-exact width per projection module (by id), filled by ``measure_widths``.
_widths: dict[int, int] = {}


def current_level() -> Level:
    scoped = _scoped.get()
    return scoped if scoped is not None else _process_level


def in_scoped_pin() -> bool:
    """Whether the current forward asked for its level (as opposed to inheriting the process's)."""
    return _scoped.get() is not None


@contextmanager
def scoped(level: Level) -> Iterator[None]:
    """Build the graphs inside this block at ``level``; everything outside keeps its own."""
    token = _scoped.set(level)
    try:
        yield
    finally:
        _scoped.reset(token)


@contextmanager
def process_scope() -> Iterator[None]:
    """Leave any scoped pin: the block's graphs are built at the process level."""
    token = _scoped.set(None)
    try:
        yield
    finally:
        _scoped.reset(token)


def process_level() -> Level:
    return _process_level


def set_process_level(level: Level) -> None:
    """The process-wide pin (``--pin-scope process``): every forward not scoped runs at ``level``."""
    global _process_level
    _process_level = level


# --------------------------------------------------------------------------- divergence seam

#: TEST SEAM. When set, called as ``seam(kind, out, rows)`` on every projection output
#: (``kind="projection"``, rows = rows computed in one kernel call) and every attention output
#: (``kind="attention"``, rows = queries in one call) and its return value is used instead. Tests
#: use it to inject the divergences that MLX's CPU backend does not produce, e.g. "perturb any
#: projection computed on more than 4 rows at once" (fixed by narrow) or "perturb multi-query
#: attention" (fixed by per-query). Never set in production.
divergence_seam: Callable[[str, mx.array, int], mx.array] | None = None


def _seam(kind: str, out: mx.array, rows: int) -> mx.array:
    seam = divergence_seam
    return out if seam is None else seam(kind, out, rows)


# --------------------------------------------------------------------------- narrow projections


def _rows_chunked(call: Callable[..., mx.array], width: int, x: mx.array, *extra: mx.array) -> mx.array:
    """``call(x, *extra)`` computed on at most ``width`` rows at a time.

    Rows are the flattened leading dimensions of ``x`` (and of each of ``extra``, e.g. MoE expert
    indices, which share them); the last dimension is the feature dimension.
    """
    lead = x.shape[:-1]
    n = 1
    for d in lead:
        n *= d
    flat = x.reshape(n, x.shape[-1])
    flat_extra = [e.reshape(n, *e.shape[len(lead) :]) for e in extra]
    parts = [call(flat[i : i + width], *(e[i : i + width] for e in flat_extra)) for i in range(0, n, width)]
    out = mx.concatenate(parts, axis=0)
    return out.reshape(*lead, *out.shape[1:])


def _rows(x: mx.array) -> int:
    return math.prod(x.shape[:-1])


def _pinnable(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """Wrap a projection method: at narrow or above, chunk rows to the module's measured width."""

    def call(self: Any, x: mx.array, *extra: Any, **kwargs: Any) -> mx.array:
        rows = _rows(x)
        if current_level() is Level.WIDE:
            # One row (classic B = 1 decode) or MoE experts (they route their rows themselves): as
            # mlx-lm calls it, with as little Python as possible on the per-token path.
            if rows == 1 or extra or kwargs:
                out = original(self, x, *extra, **kwargs)
                return out if divergence_seam is None else divergence_seam("projection", out, rows)
            out, kernel_rows = fastpath.project(lambda xs: original(self, xs), x, rows, id(self))
            return _seam("projection", out, kernel_rows)
        width = _widths.get(id(self), 1)
        if rows <= width:
            return _seam("projection", original(self, x, *extra, **kwargs), rows)

        def one(xs: mx.array, *es: mx.array) -> mx.array:
            return _seam("projection", original(self, xs, *es, **kwargs), xs.shape[0])

        return _rows_chunked(one, width, x, *extra)

    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


def _projection_classes() -> list[tuple[type, str]]:
    """(class, method) pairs that compute every projection mlx-lm models use."""
    from mlx_lm.models import switch_layers

    return [
        (nn.Linear, "__call__"),
        (nn.QuantizedLinear, "__call__"),
        (nn.Embedding, "as_linear"),  # tied output heads
        (nn.QuantizedEmbedding, "as_linear"),
        (switch_layers.SwitchGLU, "__call__"),  # MoE experts: chunked per token, router included
        (switch_layers.SwitchMLP, "__call__"),
    ]


# --------------------------------------------------------------------------- per-query attention


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


def _per_query_sdpa(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def sdpa(
        queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any, **kwargs: Any
    ) -> mx.array:
        views = cache.views if isinstance(cache, PerQueryCache) else None
        if views is None:
            keys, values = fastpath.attention_inputs(keys, values)
            return _seam(
                "attention", original(queries, keys, values, cache, scale=scale, mask=mask, **kwargs), queries.shape[2]
            )
        real = cache._cache
        outs = [
            _seam(
                "attention",
                original(
                    queries[:, :, i : i + 1], *fastpath.attention_inputs(k, v), real, scale=scale, mask=None, **kwargs
                ),
                1,
            )
            for i, (k, v) in enumerate(views)
        ]
        return mx.concatenate(outs, axis=2)

    sdpa.__wrapped__ = original  # type: ignore[attr-defined]
    return sdpa


# --------------------------------------------------------------------------- install

_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Patch the projection classes and every loaded mlx-lm model module's attention entry point.

    Idempotent. Model modules imported later are patched by calling ``install`` again (model
    loading does), since each module holds its own reference to ``scaled_dot_product_attention``.
    """
    global _installed
    with _install_lock:
        if not _installed:
            for cls, method in _projection_classes():
                setattr(cls, method, _pinnable(getattr(cls, method)))
            _installed = True
        for name, module in list(sys.modules.items()):
            if not name.startswith("mlx_lm.models.") or module is None:
                continue
            fn = getattr(module, "scaled_dot_product_attention", None)
            if callable(fn) and not hasattr(fn, "__wrapped__"):
                module.scaled_dot_product_attention = _per_query_sdpa(fn)  # type: ignore[attr-defined]


@contextmanager
def stock() -> Iterator[None]:
    """Run the block on unpatched MLX and mlx-lm (the raw peer in benchmarks), then patch again."""
    global _installed
    with _install_lock:
        was = _installed
        if was:
            for cls, method in _projection_classes():
                setattr(cls, method, getattr(cls, method).__wrapped__)
            _installed = False
        patched = {}
        for name, module in list(sys.modules.items()):
            fn = getattr(module, "scaled_dot_product_attention", None) if name.startswith("mlx_lm.models.") else None
            if fn is not None and hasattr(fn, "__wrapped__"):
                patched[name] = fn
                module.scaled_dot_product_attention = fn.__wrapped__  # type: ignore[attr-defined]
    try:
        yield
    finally:
        with _install_lock:
            for name, fn in patched.items():
                sys.modules[name].scaled_dot_product_attention = fn  # type: ignore[attr-defined]
        if was:
            install()


# --------------------------------------------------------------------------- measuring widths


@dataclass
class WidthReport:
    """Row-exact widths found for each distinct projection signature of a model."""

    widths: dict[str, int] = field(default_factory=dict)

    def narrowest(self) -> int:
        return min(self.widths.values(), default=1)


Probe = Callable[[mx.array, slice], mx.array]


def _signature_and_probe(module: nn.Module, max_width: int) -> tuple[str, Probe, int, mx.Dtype] | None:
    """A key shared by modules that compute identically, a call on a slice of input rows, and the
    input width. MoE experts get a fixed routing table so every slice routes its rows the same."""
    from mlx_lm.models import switch_layers

    if isinstance(module, nn.QuantizedLinear):
        d_in = module.weight.shape[-1] * 32 // module.bits
        sig = f"QuantizedLinear{tuple(module.weight.shape)}/{module.bits}b{module.group_size}/{module.scales.dtype}"
        return sig, lambda x, rows: module(x[rows]), d_in, module.scales.dtype
    if isinstance(module, nn.Linear):
        sig = f"Linear{tuple(module.weight.shape)}/{module.weight.dtype}"
        return sig, lambda x, rows: module(x[rows]), module.weight.shape[1], module.weight.dtype
    if isinstance(module, nn.QuantizedEmbedding):
        d_in = module.weight.shape[-1] * 32 // module.bits
        sig = f"QuantizedEmbedding.as_linear{tuple(module.weight.shape)}/{module.bits}b/{module.scales.dtype}"
        return sig, lambda x, rows: module.as_linear(x[rows]), d_in, module.scales.dtype
    if isinstance(module, nn.Embedding):
        sig = f"Embedding.as_linear{tuple(module.weight.shape)}/{module.weight.dtype}"
        return sig, lambda x, rows: module.as_linear(x[rows]), module.weight.shape[1], module.weight.dtype
    if isinstance(module, switch_layers.SwitchGLU | switch_layers.SwitchMLP):
        first = module.gate_proj if isinstance(module, switch_layers.SwitchGLU) else module.fc1
        bits = getattr(first, "bits", None)
        d_in = first.weight.shape[-1] * (32 // bits if bits else 1)
        dtype = first.scales.dtype if bits else first.weight.dtype
        table = mx.random.randint(0, first.weight.shape[0], (max_width, 2), key=mx.random.key(1))
        sig = f"{type(module).__name__}{tuple(first.weight.shape)}/{dtype}"
        return sig, lambda x, rows: module(x[rows], table[rows]), d_in, dtype
    return None


def measure_widths(model: nn.Module, max_width: int = MAX_MEASURED_WIDTH, seed: int = 0) -> WidthReport:
    """Find, for each projection signature, the widest M whose M-row call is byte-equal to M
    single-row calls for every M up to it (W = 1 when M = 2 already differs), and register the
    width for every module with that signature. Runs at wide, outside any pin."""
    install()
    report = WidthReport()
    by_sig: dict[str, list[int]] = {}
    probes: dict[str, tuple[Probe, int, mx.Dtype]] = {}
    for _, module in model.named_modules():
        found = _signature_and_probe(module, max_width)
        if found is None:
            continue
        sig, call, d_in, dtype = found
        by_sig.setdefault(sig, []).append(id(module))
        probes.setdefault(sig, (call, d_in, dtype))
    with scoped(Level.WIDE):
        for sig, (call, d_in, dtype) in probes.items():
            x = (mx.random.normal((max_width, d_in), key=mx.random.key(seed)) * 0.5).astype(dtype)
            singles = mx.concatenate([call(x, slice(i, i + 1)) for i in range(max_width)], axis=0)
            width = 1
            for m in range(2, max_width + 1):
                if not bytes_equal(call(x, slice(0, m)), singles[:m]):
                    break
                width = m
            report.widths[sig] = width
            for mid in by_sig[sig]:
                _widths[mid] = width
    return report


def bytes_equal(a: mx.array, b: mx.array) -> bool:
    """Byte equality of two arrays of the same dtype (never ``allclose``)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.all(bytes_view(a) == bytes_view(b)).item())


def bytes_view(a: mx.array) -> mx.array:
    """The array's raw bytes as unsigned integers, so NaNs and signed zeros compare exactly."""
    view = {2: mx.uint16, 4: mx.uint32, 8: mx.uint64, 1: mx.uint8}[a.dtype.size]
    return a.view(view)
