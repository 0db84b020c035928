"""The width table: how many rows each projection may compute in one call at ``narrow`` and ``per-query``.

Two tables keyed by module id: the load-time measurement (``calibration.measure_widths``), which
every probe starts from, and the widths served now, which the probe's calibration narrows and a
verdict restores. Modules are keyed by id, so an entry is dropped when its module is collected:
Python reuses the ids of dead objects, and a new module must not inherit an old one's width.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.nn as nn

#: Row counts tried when measuring a projection's row-exact width.
MAX_MEASURED_WIDTH = 16

#: Width per projection module (by id) that ``narrow`` and ``per-query`` chunk to: the load-time
#: measurement, narrowed where the probe's calibration found it does not hold.
chunk_widths: dict[int, int] = {}
#: The load-time measurement alone (``measure_widths``), which every probe starts from.
load_time_widths: dict[int, int] = {}

#: Live measured modules: id -> a serial number that no later module with the same id shares.
#: Their entries are dropped when they are collected (``_forget``).
_tracked: dict[int, int] = {}
_serials = itertools.count()


def _forget(mid: int) -> None:
    """A measured module is gone: drop its entries, so a later module that Python gives the same
    id (ids of dead objects are reused) does not inherit its width."""
    chunk_widths.pop(mid, None)
    load_time_widths.pop(mid, None)


def _untrack(mid: int) -> None:
    _tracked.pop(mid, None)
    _forget(mid)


def track_measured(model: nn.Module) -> None:
    """Watch every measured module of ``model`` so its entries go when it does."""
    for _, module in model.named_modules():
        if id(module) in load_time_widths and id(module) not in _tracked:
            _tracked[id(module)] = next(_serials)
            weakref.finalize(module, _untrack, id(module))


@contextmanager
def saved_widths() -> Iterator[None]:
    """Widths as they were before the block, for the modules that are still the same modules after
    it (tests that narrow widths): a module collected meanwhile leaves nothing behind, and a new
    module that Python gave its id does not get its width."""
    widths, measured, serials = dict(chunk_widths), dict(load_time_widths), dict(_tracked)
    try:
        yield
    finally:
        same = {mid for mid, serial in serials.items() if _tracked.get(mid) == serial}
        chunk_widths.clear()
        chunk_widths.update({mid: w for mid, w in widths.items() if mid in same})
        load_time_widths.clear()
        load_time_widths.update({mid: w for mid, w in measured.items() if mid in same})


def _projections(model: Any) -> Iterator[tuple[str, nn.Module]]:
    """(path, module) for every projection of ``model`` that has a measured width."""
    for path, module in model.named_modules():
        if id(module) in load_time_widths:
            yield path, module


def reset_widths(model: Any) -> None:
    """Back to the load-time widths, which every probe starts from."""
    for _, module in _projections(model):
        chunk_widths[id(module)] = load_time_widths[id(module)]


def widths_by_path(model: Any) -> dict[str, int]:
    """The widths ``narrow`` and ``per-query`` run with, by module path (what a verdict stores)."""
    return {path: chunk_widths[id(module)] for path, module in _projections(model)}


def apply_widths(model: Any, widths: dict[str, int]) -> None:
    """Serve with a verdict's widths: the load-time ones, with the verdict's in their place."""
    reset_widths(model)
    for path, module in _projections(model):
        if path in widths:
            chunk_widths[id(module)] = widths[path]


def every_width_one(model: Any) -> bool:
    """Whether every projection runs one row per call at ``narrow``: then ``per-query`` is ``per-query-1``."""
    return all(chunk_widths.get(id(module), 1) == 1 for _, module in _projections(model))
