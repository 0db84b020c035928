"""Projection patching: every projection call of a pinned forward made on the rows its level allows.

Each projection method mlx-lm models use (``patches.install``) is wrapped by ``pinnable``, which
reads the level in force when the forward builds its graph (``levels.current_level``): at ``wide``
the call goes straight through (``fastpath`` may route it); at ``narrow`` and ``per-query`` a call
on several rows runs in chunks of the module's width (``widths.chunk_widths``) and, while
``capturing``, is recorded for calibration; at ``per-query-1`` every row is decode's own one-row
call; at ``padded`` every call runs on exactly ``PAD_ROWS`` rows; at ``rowwise`` the project's
row-exact kernel computes the rows (``rowkernel``); at ``mirrored`` the project's kernel that
repeats decode's one-row arithmetic does, where measured equal (``qmv_rows``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from workers.api import Level
from workers.kernels import dense_shadow, dequant_matmul, fastpath, gemv_rows, qmv_rows, rowkernel, seam, w4a16
from workers.kernels.levels import current_level
from workers.kernels.widths import chunk_widths

#: Rows of every projection call at ``padded``. On MLX CUDA 16 rows reach the batched kernel, which
#: costs little more than decode's one row (fewer rows run as row-by-row products), and the real rows
#: of a 16-row call are byte-equal whatever the other rows hold.
PAD_ROWS = 16


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


def chunked(
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
        out = seam.apply("projection", original(module, xs, *es, **kwargs), m, module, xs)
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
        out = seam.apply("projection", original(module, xs, *es, **kwargs), PAD_ROWS, module, xs)
        parts.append(out[:m])
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def _through_kernel(
    level: Level,
    module: Any,
    original: Callable[..., mx.array],
    x: mx.array,
    extra: tuple[Any, ...],
    kwargs: dict[str, Any],
    rows: int,
) -> mx.array:
    """``x``'s rows through the project's kernel for ``level``: at ``rowwise`` the row-exact kernel
    (``rowkernel``), at ``mirrored`` the ones that repeat decode's one-row arithmetic (``qmv_rows`` for
    quantized layers, ``gemv_rows`` for dense ones; only on shapes measured equal to MLX's call).
    Where the kernel does not take the module, decode's own one-row call per row, which is exact by
    construction as well. ``rows``: ``x``'s rows (the caller has counted them)."""
    lead = x.shape[:-1]
    flat = x.reshape(rows, x.shape[-1])
    out = None
    if not (extra or kwargs):
        if level is Level.ROWWISE:
            out = rowkernel.project(module, flat)
        else:
            out = qmv_rows.project(module, original, flat, x)
            if out is None:
                out = gemv_rows.project(module, original, flat)
    if out is None:
        flat_extra = tuple(e.reshape(rows, *e.shape[len(lead) :]) for e in extra)
        out = chunked(module, original, 1, flat, flat_extra, kwargs, len(lead))
    elif seam.divergence_seam is not None:
        out = seam.apply(level.value, out, rows, module, flat)
    return out.reshape(*lead, *out.shape[1:])


def _rows(x: mx.array) -> int:
    return math.prod(x.shape[:-1])


#: (module id, rows) -> ``together``'s answer, for the plans of ``fastpath.generation`` ``_together_at``
#: (asked only up to ``qmv_rows.MAX_ROWS`` rows, the kernel's, so it stays a few entries a module).
_together: dict[tuple[int, int], bool] = {}
_together_at = -1


def together(module: Any, rows: int) -> bool:
    """Whether a batched (wide) call of ``module`` on ``rows`` rows runs with its siblings
    (``qmv_rows.register_siblings``) in one kernel call: every sibling is planned to the kernel at
    that row count. Each output is the one its own kernel call gives, so the plans decide only
    how many launches a layer makes (q/k/v and gate/up: 4 a layer instead of 7). Each call is a
    launch and a graph node on MLX CUDA, and at B <= 8 a step costs far more than its weights' bytes
    take to read. Where a sibling is planned
    otherwise, each module makes its own call."""
    global _together_at
    if _together_at != fastpath.generation:
        _together.clear()
        _together_at = fastpath.generation
    key = (id(module), rows)
    hit = _together.get(key)
    if hit is None:
        group = qmv_rows.siblings(module)
        hit = _together[key] = group is not None and all(
            fastpath.planned(id(m), rows) == fastpath.KERNEL for m in group
        )
    return hit


def pinnable(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """Wrap a projection method: above wide, several rows run in chunks of the module's width
    (one row at ``per-query-1``); one row is decode's call, as mlx-lm makes it, except at
    ``padded``, where every call (decode's one row included) runs on ``PAD_ROWS`` rows."""

    def call(self: Any, x: mx.array, *extra: Any, **kwargs: Any) -> mx.array:
        rows = _rows(x)
        level = current_level()
        if level is Level.WIDE:
            # MoE experts (they route their rows themselves) and one row (classic B = 1 decode) unless
            # its plan is the project's kernel: as mlx-lm calls it, with as little Python as possible.
            if extra or kwargs or (rows == 1 and id(self) not in fastpath.one_row):
                out = original(self, x, *extra, **kwargs)
                return out if seam.divergence_seam is None else seam.apply("projection", out, rows, self, x)
            # A plan's ``fastpath.KERNEL`` rows: one kernel call per projection, or per sibling group
            # (q/k/v, gate/up) where every sibling is planned to the kernel at these rows.
            source = x if rows <= qmv_rows.MAX_ROWS and together(self, rows) else None
            out, kernel_rows = fastpath.project(
                lambda xs: original(self, xs),
                x,
                rows,
                id(self),
                lambda xs: qmv_rows.project(self, original, xs, source),
                lambda xs, tile: w4a16.project(self, xs, tile),
                lambda xs: dense_shadow.project(self, xs),
                lambda xs: dequant_matmul.project(self, xs),
            )
            return out if seam.divergence_seam is None else seam.apply("projection", out, kernel_rows, self, x)
        if level is Level.ROWWISE or (level is Level.MIRRORED and rows > 1):
            return _through_kernel(level, self, original, x, extra, kwargs, rows)
        if level is Level.PADDED:
            lead = x.shape[:-1]
            flat_extra = tuple(e.reshape(rows, *e.shape[len(lead) :]) for e in extra)
            out = _padded(self, original, x.reshape(rows, x.shape[-1]), flat_extra, kwargs)
            return out.reshape(*lead, *out.shape[1:])
        if rows == 1:
            return seam.apply("projection", original(self, x, *extra, **kwargs), 1, self, x)
        width = 1 if level is Level.PER_QUERY_1 else chunk_widths.get(id(self), 1)
        lead = x.shape[:-1]
        flat = x.reshape(rows, x.shape[-1])
        flat_extra = tuple(e.reshape(rows, *e.shape[len(lead) :]) for e in extra)
        calls = _capture.get()
        if calls is not None and width > 1:
            calls.append(CapturedCall(self, original, flat, flat_extra, kwargs, len(lead)))
        out = chunked(self, original, width, flat, flat_extra, kwargs, len(lead))
        return out.reshape(*lead, *out.shape[1:])

    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call
