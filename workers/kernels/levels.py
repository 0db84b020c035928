"""Kernel levels: buying back exactness for a verify block, scoped to that one forward.

A speculative verify runs T > 1 tokens through the target in one forward. Whether its logits are
byte-equal to T single-token decode steps depends on the backend's kernels: wide
matmuls may reduce in a different order than ``M = 1``, and multi-query masked attention differs
from decode's single-query, mask-free call, and even from it over a differently laid-out cache.

Levels (the ladder), in the order the probe tries them (``ladder()``; ``mirrored``, ``rowwise`` and
``padded`` are tried only on MLX CUDA, right after ``wide``):

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
- ``mirrored``: per-query attention, and each quantized projection of the block through the project's
  kernel that performs decode's own one-row kernel arithmetic on several rows in one weight pass
  (``qmv_rows``), used per layer shape only where it was measured byte-equal to MLX's one-row call;
  every other projection is decode's own one-row call per row. Classic decode is not pinned: the
  block reproduces MLX's decode, at about one weight pass per projection.
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
is the seed project's process-wide pin, kept only as a bench arm (the comparison that shows scoping pays).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from workers.api import Level
from workers.kernels import fastpath

LADDER: tuple[Level, ...] = (Level.WIDE, Level.NARROW, Level.PER_QUERY, Level.PER_QUERY_1)


def ladder() -> tuple[Level, ...]:
    """The rungs in the order the probe tries them on this backend: ``mirrored`` right after ``wide``
    (it keeps classic decode as it is), then ``rowwise``, both where the project's kernels run
    (``qmv_rows.usable``, ``rowkernel.usable``: its start-up check passed), then ``padded`` where it is
    measured cheaper than chunking (MLX CUDA, ``fastpath``'s switch); elsewhere none of them (an
    operator may still pin them with ``pin_level``)."""
    from workers.kernels import qmv_rows, rowkernel

    first: tuple[Level, ...] = (Level.MIRRORED,) if qmv_rows.usable() else ()
    first += (Level.ROWWISE,) if rowkernel.usable() else ()
    if fastpath.active().padded_first:
        first += (Level.PADDED,)
    return (Level.WIDE, *first, *LADDER[1:])


_scoped: ContextVar[Level | None] = ContextVar("mlx_batchd_scoped_level", default=None)
_process_level: Level = Level.WIDE


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
    """The process-wide pin (a bench arm, never a daemon's): every forward not scoped runs at ``level``."""
    global _process_level
    _process_level = level
