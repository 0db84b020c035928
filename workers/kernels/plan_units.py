"""Calibrating a model's kernel plans (``plan_timing``'s timings, ``plan_store``'s store) in units.

A unit is one shape's timing, one row count's forward check or one row count's kernel warm-up.
``calibrate`` runs them all before it returns (tests, benchmarks, ``mlx-batchd probe``); a daemon
whose store holds no plans for the model serves at once with none installed (every projection as
mlx-lm calls it: correct, slower on CUDA) and runs ``calibration_steps`` a unit at a time between
its steps (``workers.engine.background``); stored plans (``stored_plans``) are warmed the same way
(``warming_steps``) before they are installed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from workers.kernels import dense_shadow, dequant_matmul, fastpath, plan_store, plan_timing, qmv_rows, w4a16
from workers.kernels.plan_timing import Plans

log = logging.getLogger("mlx_batchd")

T = TypeVar("T")


@dataclass(frozen=True)
class Shapes:
    """What calibrating a model covers: its distinct projection shapes (each timed on its first
    module), the policy's row range, the large row counts (where the w4a16 kernel or a transient
    dequantized weight takes a shape, or one has a dequantized shadow) and whether a shape has the shadow (``dense_shadow``)."""

    first: dict[str, nn.Module]
    n: int
    large: tuple[int, ...]
    dense: bool = False

    @property
    def names(self) -> list[str]:
        return sorted(self.first)

    def load_or_time(self, store: Path | None, time_plans: Callable[[], Plans]) -> tuple[Plans, bool]:
        """``plan_store.load_or_time`` for these shapes."""
        return plan_store.load_or_time(
            store, self.names, self.n, fastpath.PADS, time_plans, qmv_rows.MAX_ROWS, self.large, self.dense
        )


def shapes_of(model: nn.Module, max_batch: int | None = None) -> Shapes | None:
    """``model``'s shapes to calibrate for decode steps of at most ``max_batch`` sequences (``None``:
    every ``fastpath.LARGE_ROWS``), or ``None`` where the active policy does not calibrate."""
    n = fastpath.active().calibrate_rows
    if not n:
        return None
    qmv_rows.register_siblings(model)  # siblings all planned to the kernel share its calls
    first = {shape: m for m, shape in reversed(fastpath._projections(model))}
    large_ways = any(w4a16.takes(m) or dequant_matmul.takes(m) for m in first.values())
    dense = any(dense_shadow.has(m) for m in first.values())
    return Shapes(first, n, fastpath.large_rows(max_batch) if large_ways or dense else (), dense)


def timing_steps(model: nn.Module, sh: Shapes, report: dict[int, dict[str, Any]]) -> Generator[str, None, Plans]:
    """Timing as units (yielding what each did): a shape's plan a way's first call or a row count
    at a time (``time_plan_steps``), then one row count's forward check (``forward_check_steps``);
    ends in the plans. A forward check that fails keeps the per-shape plans."""
    names = sh.names
    plans: Plans = {}
    for i, shape in enumerate(names, 1):
        plans[shape] = yield from plan_timing.time_plan_steps(sh.first[shape], sh.n, sh.large)
        yield f"{i}/{len(names)} shapes timed"
    if not plan_timing.decodes(model):
        return plans
    kernel_shapes = {shape for shape in names if 1 in plans[shape]}  # one row is timed where the kernel takes it
    mma_shapes = {shape for shape in names if w4a16.takes(sh.first[shape])}
    dense_shapes = {shape for shape in names if dense_shadow.has(sh.first[shape])}
    dequant_shapes = {shape for shape in names if dequant_matmul.takes(sh.first[shape])}
    checked = {shape: dict(plan) for shape, plan in plans.items()}
    try:
        steps = plan_timing.forward_check_steps(
            model, checked, kernel_shapes, sh.n, report, mma_shapes, dense_shapes, dequant_shapes
        )
        return (yield from steps)
    except Exception:  # a model whose decode forward this check cannot run keeps the per-shape plans
        log.warning("kernel plans: the whole-forward check failed; keeping the per-shape plans", exc_info=True)
        return plans


def calibrate(
    model: nn.Module,
    store: Path | None = None,
    report: dict[int, dict[str, Any]] | None = None,
    max_batch: int | None = None,
) -> dict[str, dict[int, int]]:
    """Plan every distinct projection shape of ``model`` for 2..``calibrate_rows`` rows (and one row,
    where the project's kernel takes the shape), check each row count's plans on the model's decode
    forward (``plan_timing.forward_checked``), and install them (``fastpath.install``); returns them by shape. A no-op unless the
    active policy calibrates. With ``store`` (``workers.kernels.plan_store``) the plans are timed once per
    machine and kept there, so every process serving the model runs the same kernels. ``report``
    (when timed here) gets the forward check's milliseconds, which the store also keeps beside the
    plans (``plan_store.keep_check``). All before returning: ``calibration_steps`` is the same work
    in units, for an engine that serves meanwhile. ``max_batch`` bounds the large row counts timed
    (``fastpath.large_rows``)."""
    sh = shapes_of(model, max_batch)
    if sh is None:
        return {}
    report = {} if report is None else report
    tic = time.perf_counter()
    by_shape, stored = sh.load_or_time(store, lambda: plan_timing.drive(timing_steps(model, sh, report)))
    how = "read from the store" if stored else f"timed in {time.perf_counter() - tic:.1f} s"
    log.info("kernel plans for %d projection shapes %s", len(sh.first), how)
    if not stored and store is not None and report:
        plan_store.keep_check(store, sh.names, sh.n, fastpath.PADS, report, sh.large, sh.dense)
    plan_timing.drive(warming_steps(model, by_shape))
    return by_shape


class _NotStored(Exception):
    """The store holds no plans for these shapes (``stored_plans``' stand-in for timing them)."""


def _not_stored() -> Plans:
    raise _NotStored


def stored_plans(model: nn.Module, store: Path | None, max_batch: int | None = None) -> Plans | None:
    """The plans the store holds for ``model`` (not installed), ``{}`` where the policy does not
    calibrate, ``None`` where the store holds none (``calibration_steps`` then times them)."""
    sh = shapes_of(model, max_batch)
    if sh is None:
        return {}
    try:
        by_shape, _ = sh.load_or_time(store, _not_stored)
    except _NotStored:
        return None
    log.info("kernel plans for %d projection shapes read from the store", len(sh.first))
    return by_shape


def calibration_steps(
    model: nn.Module, store: Path | None, max_batch: int | None = None
) -> Generator[str, None, Plans]:
    """``calibrate`` as units, for an engine that serves between them: one shape's timing, one row
    count's forward check, one row count's kernel warm-up (each yields what it did). Between units
    ``model`` runs with no plans installed (as mlx-lm calls every projection), whatever a unit
    installed to time it; at the end the plans are stored (another process's, stored meanwhile, win:
    every process on the machine runs the same kernels) and installed, and returned."""
    sh = shapes_of(model, max_batch)
    if sh is None:
        return {}
    report: dict[int, dict[str, Any]] = {}
    plans = yield from _uninstalling(model, timing_steps(model, sh, report))
    by_shape, stored = sh.load_or_time(store, lambda: plans)
    if stored:
        log.info("kernel plans: another process stored its plans meanwhile; those are installed")
    elif store is not None and report:
        plan_store.keep_check(store, sh.names, sh.n, fastpath.PADS, report, sh.large, sh.dense)
    return (yield from warming_steps(model, by_shape))


def _uninstalling(model: nn.Module, steps: Generator[str, None, T]) -> Generator[str, None, T]:
    """``steps``, with ``model``'s plans removed after each unit (and after a failed one)."""
    while True:
        try:
            label = next(steps)
        except StopIteration as done:
            result: T = done.value
            break
        finally:
            uninstall(model)
        yield label
    return result


def uninstall(model: nn.Module) -> None:
    """Remove every plan installed for ``model``'s projections: each runs as mlx-lm calls it (flattened
    where the policy flattens), as before any calibration."""
    for m, _ in fastpath._projections(model):
        fastpath._forget(id(m))


def warm_rows(model: nn.Module, plans: Plans) -> list[int]:
    """The row counts ``plans`` send to a project kernel (``KERNEL``, ``MMA`` or an ``MMA`` tile) on a ``model`` whose
    decode forward can warm them: each kernel compiles at its first call (and the row kernel checks
    each layer shape against MLX's one-row call)."""
    if not plan_timing.decodes(model):
        return []
    kernels = (
        r for plan in plans.values() for r, to in plan.items() if to == fastpath.KERNEL or fastpath.tile(to) is not None
    )
    return sorted(set(kernels))


def warming_steps(model: nn.Module, by_shape: Plans) -> Generator[str, None, Plans]:
    """``by_shape``'s kernels warmed a row count a unit (``warm_kernel_steps``), the plans installed
    for each unit only (between units every projection runs as mlx-lm calls it, so no request pays a
    compile), then installed for good; returns ``by_shape``."""
    tic = time.perf_counter()
    rows = yield from _uninstalling(model, warm_kernel_steps(model, by_shape))
    if rows:
        log.info("kernel plans: the project's kernels run at %s rows in %.1f s", rows, time.perf_counter() - tic)
    fastpath.install(model, by_shape)
    return by_shape


def warm_kernel_steps(model: nn.Module, plans: Plans) -> Generator[str, None, list[int]]:
    """Two forwards, with ``plans`` installed, at every row count they send to a project kernel
    (``warm_rows``): two tokens a row, then one on that cache (a decode step), a unit each; returns
    those row counts.

    Why: the row kernel checks each layer shape (or sibling group) against MLX's one-row call, and
    each kernel compiles at its first call in a process (MLX keeps no custom kernel's compile on
    disk). Plans read from the store skip the timing that would otherwise have made those
    calls, and a daemon then paid them inside the first request whose batch reached such a row count."""
    rows = warm_rows(model, plans)
    for r in rows:
        fastpath.install(model, plans)
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((r, 2), dtype=mx.int32), cache=cache))
        yield f"kernels warmed at {r} rows, two tokens a row"
        fastpath.install(model, plans)  # each unit installs them for itself (``_uninstalling``)
        mx.eval(model(mx.zeros((r, 1), dtype=mx.int32), cache=cache))
        yield f"kernels warmed at {r} rows"
    return rows
