"""Kernel levels: buying back exactness for a verify block, scoped to that one forward.

A speculative verify runs T > 1 tokens through the target in one forward. Whether its logits are
byte-equal to T single-token decode steps depends on the backend's kernels: wide
matmuls may reduce in a different order than ``M = 1``, and multi-query masked attention differs
from decode's single-query, mask-free call, and even from it over a differently laid-out cache.

Levels (the ladder), in the order the probe tries them (``ladder()``; ``rowwise`` and ``padded`` are
tried only on MLX CUDA, right after ``wide``):

- ``wide``: MLX's own dispatch.
- ``narrow``: every projection on more rows than its width ``W`` runs in row chunks of at most
  ``W``. ``W`` starts at the width measured at load on random inputs (``measure_widths``) and is
  then calibrated on the probe's own activations (``capturing`` + ``calibrate``): a width that
  does not hold on the rows a real block feeds that module is narrowed until it does.
- ``per-query``: narrow, plus attention computed one query at a time *through the cache's own
  update path*: each of the block's tokens is written to the cache as decode would write it, and
  attends with decode's single-query, mask-free call over exactly the view decode would get. The
  cache's physical order and memory layout are decode's by construction, rotating caches included.
- ``per-query-1``: per-query with every projection on one row per call, in decode's own call
  shape. Every projection and attention call of the block is then the very call decode makes for
  that row, so no width is involved, measured or calibrated; what still runs on the block's rows
  together are the per-row operations between them (norms, RoPE, activations, residual adds). The
  probe verifies this rung like the others.
- ``rowwise``: every projection of the lone sequence's forwards, the verify block's and classic
  decode's, runs through the project's row-exact kernel (``rowkernel``: one pass over the weights
  for up to 8 rows, each row reduced in one fixed order), attention per-query. Exact by
  construction like ``padded``, and it pins classic decode the same way, but a block costs about
  one pass over the weights instead of a 16-row batched call.
- ``padded``: every projection of the lone sequence's forwards, the verify block's *and classic
  decode's*, runs on exactly ``PAD_ROWS`` rows (zero rows added), and attention is per-query. The
  rows a kernel call sees no longer depend on how many tokens the forward carries, so the chain
  and the block make the same projection calls for each row by construction; no width is
  measured. It is the one rung that pins classic decode too (``Level.pins_chain``): while it is
  the verdict, the lone sequence's classic steps run padded, and that cost is the pin's.

A level applies to the graph built while it is in force. MLX is lazy, so what matters is which
level was current when a forward *built* its graph; the engine thread builds every graph, so a
level entered with ``scoped()`` around one forward touches that forward only. ``set_process_level``
is the seed project's process-wide pin, kept only for comparison.

The projection and attention entry points of MLX and mlx-lm are patched once (``install``); at
``wide`` the patches call straight through.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import threading
import weakref
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
    PADDED = "padded"
    ROWWISE = "rowwise"
    PER_QUERY_1 = "per-query-1"

    @property
    def per_query(self) -> bool:
        """Whether attention runs one query at a time through the cache's update path."""
        return self in (Level.PER_QUERY, Level.PADDED, Level.ROWWISE, Level.PER_QUERY_1)

    @property
    def pins_chain(self) -> bool:
        """Whether classic decode of the lone sequence must run at this level too for a verify at
        it to equal classic decode (``padded``: one row and five rows both become ``PAD_ROWS``;
        ``rowwise``: both go through the project's kernel)."""
        return self in (Level.PADDED, Level.ROWWISE)

    @property
    def calibrated(self) -> bool:
        """Whether projections run in chunks of a per-module width (calibrated by the probe)."""
        return self in (Level.NARROW, Level.PER_QUERY)


LADDER: tuple[Level, ...] = (Level.WIDE, Level.NARROW, Level.PER_QUERY, Level.PER_QUERY_1)


def ladder() -> tuple[Level, ...]:
    """The rungs in the order the probe tries them on this backend: ``rowwise`` right after ``wide``
    where the project's kernel runs and passed its check (``rowkernel.usable``), then ``padded`` where it is
    measured cheaper than chunking (MLX CUDA, ``fastpath``'s switch); elsewhere neither (an operator
    may still pin them with ``--pin-level``)."""
    from workers import rowkernel

    first: tuple[Level, ...] = (Level.ROWWISE,) if rowkernel.usable() else ()
    if fastpath.active().padded_first:
        first += (Level.PADDED,)
    return (Level.WIDE, *first, *LADDER[1:])


#: Rows of every projection call at ``padded``. On MLX CUDA (H200, 4-bit 14336 x 4096) 16 rows reach
#: the batched kernel at 0.112 ms against 0.092 ms for decode's one row (8 rows: 0.377 ms), and the
#: real rows of a 16-row call are byte-equal whatever the other rows hold.
PAD_ROWS = 16

#: Row counts tried when measuring a projection's row-exact width.
MAX_MEASURED_WIDTH = 16

#: KV capacity growth, in tokens, of the single-sequence caches the probe and bursts use (mlx-lm
#: grows ``KVCache`` in steps of 256). Each growth re-allocates the buffer, so the views a chain and
#: a block attend over change layout at different moments; with this step a sequence's views keep
#: one layout until its context crosses a multiple of 4,096 tokens. The price is memory: every
#: single-sequence cache holds at least 4,096 positions. Batched caches keep mlx-lm's step.
LAYOUT_STEP = 4096

_scoped: ContextVar[Level | None] = ContextVar("mlx_batchd_scoped_level", default=None)
_process_level: Level = Level.WIDE
#: Width per projection module (by id) that ``narrow`` and ``per-query`` chunk to: the load-time
#: measurement, narrowed where the probe's calibration found it does not hold.
_widths: dict[int, int] = {}
#: The load-time measurement alone (``measure_widths``), which every probe starts from.
_measured: dict[int, int] = {}


def _forget(mid: int) -> None:
    """A measured module is gone: drop its entries, so a later module that Python gives the same
    id (ids of dead objects are reused) does not inherit its width."""
    _widths.pop(mid, None)
    _measured.pop(mid, None)


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
#: (``kind="attention"``, rows = queries in one call) and its return value is used instead; while
#: it runs, ``seam_call`` says which call it is looking at (the projection module and its input
#: rows, or the attention's queries), so a test can make a divergence depend on the data, as
#: real kernels' byte differences do. Tests use it to inject the divergences that MLX's CPU
#: backend does not produce, e.g. "perturb any projection computed on more than 4 rows at once"
#: (fixed by narrow) or "perturb multi-query attention" (fixed by per-query). Never set in production.
divergence_seam: Callable[[str, mx.array, int], mx.array] | None = None


@dataclass(frozen=True)
class SeamCall:
    """The call ``divergence_seam`` is looking at: the projection module (``None`` for attention)
    and the call's input as the kernel got it (projection rows, or attention queries)."""

    module: Any
    inputs: mx.array


#: Set only while ``divergence_seam`` runs.
seam_call: SeamCall | None = None


def _seam(kind: str, out: mx.array, rows: int, module: Any = None, inputs: mx.array | None = None) -> mx.array:
    global seam_call
    seam = divergence_seam
    if seam is None:
        return out
    seam_call = SeamCall(module, out if inputs is None else inputs)
    try:
        return seam(kind, out, rows)
    finally:
        seam_call = None


# --------------------------------------------------------------------------- narrow projections


@dataclass
class CapturedCall:
    """One projection call of a pinned forward on several rows, kept for calibration: the rows
    flattened (``rows``, with any per-row ``extra`` inputs such as MoE expert indices) and the rank
    of the leading dimensions mlx-lm called it with (decode's call has ones there)."""

    module: Any
    original: Callable[..., mx.array]
    rows: mx.array
    extra: tuple[mx.array, ...]
    kwargs: dict[str, Any]
    lead_rank: int


_capture: ContextVar[list[CapturedCall] | None] = ContextVar("mlx_batchd_capture", default=None)


@contextmanager
def capturing(calls: list[CapturedCall] | None = None) -> Iterator[list[CapturedCall]]:
    """Record into ``calls`` (a new list when none is given) every projection call on several rows
    built inside the block at a calibrated level, so ``calibrate`` can check its width on them."""
    calls = [] if calls is None else calls
    token = _capture.set(calls)
    try:
        yield calls
    finally:
        _capture.reset(token)


def _chunked(
    module: Any,
    original: Callable[..., mx.array],
    width: int,
    rows: mx.array,
    extra: tuple[mx.array, ...],
    kwargs: dict[str, Any],
    lead_rank: int,
) -> mx.array:
    """``original`` over ``rows`` (flattened) in calls of at most ``width`` rows; returns the
    outputs stacked on one leading row axis. A one-row call is made in decode's own shape (ones
    for every leading dimension), so it is the very call classic decode makes for that row."""
    n = rows.shape[0]
    parts = []
    for i in range(0, n, width):
        m = min(width, n - i)
        xs, es = rows[i : i + m], [e[i : i + m] for e in extra]
        if m == 1:
            ones = (1,) * lead_rank
            xs, es = xs.reshape(*ones, xs.shape[-1]), [e.reshape(*ones, *e.shape[1:]) for e in es]
        out = _seam("projection", original(module, xs, *es, **kwargs), m, module, xs)
        parts.append(out.reshape(1, *out.shape[lead_rank:]) if m == 1 else out)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def _padded(
    module: Any,
    original: Callable[..., mx.array],
    rows: mx.array,
    extra: tuple[mx.array, ...],
    kwargs: dict[str, Any],
) -> mx.array:
    """``original`` over ``rows`` (flattened) in calls of exactly ``PAD_ROWS`` rows, zero rows
    added to the last; returns the real rows' outputs stacked on one leading row axis."""
    n = rows.shape[0]
    parts = []
    for i in range(0, n, PAD_ROWS):
        m = min(PAD_ROWS, n - i)
        xs, es = rows[i : i + m], [e[i : i + m] for e in extra]
        if m < PAD_ROWS:
            xs = mx.concatenate([xs, mx.zeros((PAD_ROWS - m, *xs.shape[1:]), dtype=xs.dtype)])
            es = [mx.concatenate([e, mx.zeros((PAD_ROWS - m, *e.shape[1:]), dtype=e.dtype)]) for e in es]
        out = _seam("projection", original(module, xs, *es, **kwargs), PAD_ROWS, module, xs)
        parts.append(out[:m])
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def _rowwise(
    module: Any, original: Callable[..., mx.array], x: mx.array, extra: tuple[Any, ...], kwargs: dict[str, Any]
) -> mx.array:
    """The project's row-exact kernel over ``x``'s rows (``rowkernel``); where it does not cover the
    module, decode's own one-row call per row (exact by construction as well)."""
    from workers import rowkernel

    rows = _rows(x)
    lead = x.shape[:-1]
    flat = x.reshape(rows, x.shape[-1])
    out = None if extra or kwargs else rowkernel.project(module, flat)
    if out is None:
        flat_extra = tuple(e.reshape(rows, *e.shape[len(lead) :]) for e in extra)
        out = _chunked(module, original, 1, flat, flat_extra, kwargs, len(lead))
    else:
        out = _seam("rowwise", out, rows, module, flat)
    return out.reshape(*lead, *out.shape[1:])


def _rows(x: mx.array) -> int:
    return math.prod(x.shape[:-1])


def _pinnable(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """Wrap a projection method: above wide, several rows run in chunks of the module's width
    (one row at ``per-query-1``); one row is decode's call, as mlx-lm makes it, except at
    ``padded``, where every call (decode's one row included) runs on ``PAD_ROWS`` rows."""

    def call(self: Any, x: mx.array, *extra: Any, **kwargs: Any) -> mx.array:
        rows = _rows(x)
        level = current_level()
        if level is Level.WIDE:
            # One row (classic B = 1 decode) or MoE experts (they route their rows themselves): as
            # mlx-lm calls it, with as little Python as possible on the per-token path.
            if rows == 1 or extra or kwargs:
                out = original(self, x, *extra, **kwargs)
                return out if divergence_seam is None else _seam("projection", out, rows, self, x)
            out, kernel_rows = fastpath.project(lambda xs: original(self, xs), x, rows, id(self))
            return out if divergence_seam is None else _seam("projection", out, kernel_rows, self, x)
        if level is Level.ROWWISE:
            return _rowwise(self, original, x, extra, kwargs)
        if level is Level.PADDED:
            lead = x.shape[:-1]
            flat_extra = tuple(e.reshape(rows, *e.shape[len(lead) :]) for e in extra)
            out = _padded(self, original, x.reshape(rows, x.shape[-1]), flat_extra, kwargs)
            return out.reshape(*lead, *out.shape[1:])
        if rows == 1:
            return _seam("projection", original(self, x, *extra, **kwargs), 1, self, x)
        width = 1 if level is Level.PER_QUERY_1 else _widths.get(id(self), 1)
        lead = x.shape[:-1]
        flat = x.reshape(rows, x.shape[-1])
        flat_extra = tuple(e.reshape(rows, *e.shape[len(lead) :]) for e in extra)
        calls = _capture.get()
        if calls is not None and width > 1:
            calls.append(CapturedCall(self, original, flat, flat_extra, kwargs, len(lead)))
        out = _chunked(self, original, width, flat, flat_extra, kwargs, len(lead))
        return out.reshape(*lead, *out.shape[1:])

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
            out = original(queries, keys, values, cache, scale=scale, mask=mask, **kwargs)
            return _seam("attention", out, queries.shape[2], None, queries)
        real = cache._cache
        outs = []
        for i, (k, v) in enumerate(views):
            q = queries[:, :, i : i + 1]
            out = original(q, *fastpath.attention_inputs(k, v), real, scale=scale, mask=None, **kwargs)
            outs.append(_seam("attention", out, 1, None, q))
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
                _widths[mid] = _measured[mid] = width
    for _, module in model.named_modules():
        if id(module) in _measured and id(module) not in _tracked:
            _tracked[id(module)] = next(_serials)
            weakref.finalize(module, _untrack, id(module))
    return report


#: Live measured modules: id -> a serial number that no later module with the same id shares.
#: Their entries are dropped when they are collected (``_forget``).
_tracked: dict[int, int] = {}
_serials = itertools.count()


def _untrack(mid: int) -> None:
    _tracked.pop(mid, None)
    _forget(mid)


@contextmanager
def saved_widths() -> Iterator[None]:
    """Widths as they were before the block, for the modules that are still the same modules after
    it (tests that narrow widths): a module collected meanwhile leaves nothing behind, and a new
    module that Python gave its id does not get its width."""
    widths, measured, serials = dict(_widths), dict(_measured), dict(_tracked)
    try:
        yield
    finally:
        same = {mid for mid, serial in serials.items() if _tracked.get(mid) == serial}
        _widths.clear()
        _widths.update({mid: w for mid, w in widths.items() if mid in same})
        _measured.clear()
        _measured.update({mid: w for mid, w in measured.items() if mid in same})


# --------------------------------------------------------------------------- calibrating widths


def calibrate(calls: list[CapturedCall]) -> dict[int, tuple[int, int]]:
    """Check each captured call's width on the rows it was actually given, and narrow it where it
    does not hold: the widest ``w`` no wider than the module's width (and its row count) whose
    chunked calls are byte-equal to one-row calls in decode's shape on those rows (``W = 1`` when
    none is). Returns ``{module id: (width before, width after)}`` for every module narrowed.

    A width measured at load holds on the random rows it was measured on; whether a kernel's
    multi-row call reduces like its one-row call can depend on the data, so the probe verifies each
    width on the rows of the draw it is used for."""
    todo = [c for c in calls if _widths.get(id(c.module), 1) > 1 and c.rows.shape[0] > 1]

    def outputs(c: CapturedCall, width: int) -> mx.array:
        return _chunked(c.module, c.original, width, c.rows, c.extra, c.kwargs, c.lead_rank)

    singles = [outputs(c, 1) for c in todo]
    tops = [min(_widths.get(id(c.module), 1), c.rows.shape[0]) for c in todo]
    holds = _all_bytes_equal([(outputs(c, top), one) for c, top, one in zip(todo, tops, singles, strict=True)])
    narrowed: dict[int, tuple[int, int]] = {}
    for c, top, one, ok in zip(todo, tops, singles, holds, strict=True):
        if ok:
            continue
        width = next((w for w in range(top - 1, 1, -1) if bytes_equal(outputs(c, w), one)), 1)
        mid = id(c.module)
        before = narrowed.get(mid, (_widths[mid], width))[0]
        _widths[mid] = min(_widths[mid], width)
        narrowed[mid] = (before, _widths[mid])
    return narrowed


def _all_bytes_equal(pairs: list[tuple[mx.array, mx.array]]) -> list[bool]:
    """``bytes_equal`` for many pairs, read back from the device once."""
    flags = [
        mx.all(bytes_view(a) == bytes_view(b)) if a.shape == b.shape and a.dtype == b.dtype else mx.array(False)
        for a, b in pairs
    ]
    return [bool(f) for f in mx.stack(flags).tolist()] if flags else []  # type: ignore[union-attr]


def _projections(model: Any) -> Iterator[tuple[str, nn.Module]]:
    """(path, module) for every projection of ``model`` that has a measured width."""
    for path, module in model.named_modules():
        if id(module) in _measured:
            yield path, module


def reset_widths(model: Any) -> None:
    """Back to the load-time widths, which every probe starts from."""
    for _, module in _projections(model):
        _widths[id(module)] = _measured[id(module)]


def widths_by_path(model: Any) -> dict[str, int]:
    """The widths ``narrow`` and ``per-query`` run with, by module path (what a verdict stores)."""
    return {path: _widths[id(module)] for path, module in _projections(model)}


def apply_widths(model: Any, widths: dict[str, int]) -> None:
    """Serve with a verdict's widths: the load-time ones, with the verdict's in their place."""
    reset_widths(model)
    for path, module in _projections(model):
        if path in widths:
            _widths[id(module)] = widths[path]


def every_width_one(model: Any) -> bool:
    """Whether every projection runs one row per call at ``narrow``: then ``per-query`` is ``per-query-1``."""
    return all(_widths.get(id(module), 1) == 1 for _, module in _projections(model))


# --------------------------------------------------------------------------- cache layout


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


def bytes_equal(a: mx.array, b: mx.array) -> bool:
    """Byte equality of two arrays of the same dtype (never ``allclose``)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.all(bytes_view(a) == bytes_view(b)).item())


def bytes_view(a: mx.array) -> mx.array:
    """The array's raw bytes as unsigned integers, so NaNs and signed zeros compare exactly."""
    view = {2: mx.uint16, 4: mx.uint32, 8: mx.uint64, 1: mx.uint8}[a.dtype.size]
    return a.view(view)
