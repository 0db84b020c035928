"""Row-count plans kept on disk, so every process on a machine runs a model's projections one way.

``plan_timing.calibrate`` times each projection shape at load. Timed in each process, the plans came
out differently from one start to the next (near-ties fall either way on a GPU), and two processes
serving one model then
ran different kernels: a benchmark compared the plans' luck as much as the processes. Plans are
therefore timed once per machine and kept, keyed by everything they depend on (the backend and its
versions, the projection shapes, the policy's row range, the project kernel's launch settings,
``PLAN_VERSION``), under ``$MLX_BATCHD_CACHE/kernel-plans/``; deleting that folder re-times them. A
file lock makes one process time while the others wait and then read its plans.

A stored file is used only when it reads back as valid plans for exactly the shapes asked for:
a damaged or forged file is never trusted (it is timed again and rewritten), and no value in it can
make a projection drop or mix rows (every planned call covers its rows).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from workers import envs
from workers.kernels import dense_shadow, dequant_matmul, fastpath, qmv_launch, w4a16_source
from workers.kernels.backend import backend_fingerprint

log = logging.getLogger("mlx_batchd")

#: Bump when the timing method changes, so stored plans are timed again.
PLAN_VERSION = 8

#: The longest a process waits for another to finish timing (timing takes seconds).
LOCK_WAIT_S = 120.0
#: A plan file is a few kilobytes; a larger one is not read.
MAX_FILE_BYTES = 1 << 20

Plans = dict[str, dict[int, int]]


def plan_key(
    shapes: list[str], max_rows: int, pads: tuple[int, ...], large: tuple[int, ...] = (), dense: bool = False
) -> str:
    """The plans' file name for these inputs; ``dense``: timed with the dequantized shadow (``fastpath.DENSE``)."""
    body = {
        "backend": backend_fingerprint(),
        "shapes": sorted(shapes),
        "rows": max_rows,
        "pads": list(pads),
        "kernel": qmv_launch.variant(),
        "large": list(large),
        "w4a16": w4a16_source.variant() if large else "",
        "offered": offered() if large else [],
        **({"dense_shadow": True} if dense else {}),  # absent when off: plans timed without it keep their key
    }
    return hashlib.sha256(json.dumps({**body, "version": PLAN_VERSION}, sort_keys=True).encode()).hexdigest()


def offered() -> list[str]:
    """The large-row ways this process's switches leave to the timing (``MLX_BATCHD_W4A16``,
    ``MLX_BATCHD_DEQUANT``): plans timed without one are kept apart from plans timed with it."""
    return [name for name, var in (("w4a16", envs.W4A16), ("dequant", envs.DEQUANT)) if envs.switch(var) is not False]


def valid(
    plans: Any,
    shapes: list[str],
    max_rows: int,
    pads: tuple[int, ...],
    kernel_rows: int = 0,
    large: tuple[int, ...] = (),
    dense: bool = False,
) -> Plans:
    """``plans`` as read from a file, checked: every shape, every row count 2..max_rows (and perhaps
    one row and some of the ``large`` row counts), each planned to 0 (as called), to a call of at
    least its rows (itself or a pad size), to the project's kernel (``-1``, up to ``kernel_rows``
    rows) or, with ``large``, to the w4a16 kernel (``-2``, or below it for its other tiles) or, with
    ``dense`` (timed with the shadow), from ``dense_shadow.MIN_ROWS`` rows to it (``fastpath.DENSE``), or with
    ``large``, from ``dequant_matmul.MIN_ROWS`` rows to a transient dequantized weight (``fastpath.DEQUANT``); one row
    only as called (1) or to the kernel; a large row count only flattened or to either kernel."""
    if not isinstance(plans, dict) or set(plans) != set(shapes):
        raise ValueError("the file holds plans for other shapes")
    out: Plans = {}
    for shape, plan in plans.items():
        if not isinstance(plan, dict):
            raise ValueError(f"{shape}: not a plan")
        parsed = {int(rows): int(to) for rows, to in plan.items()}
        if set(parsed) - {1} - set(large) != set(range(2, max_rows + 1)):
            raise ValueError(f"{shape}: other row counts")
        for rows, to in parsed.items():
            kernel = to == -1 and rows <= kernel_rows
            tile = fastpath.tile(to)
            mma = tile is not None and tile < len(w4a16_source.TILES) and bool(large) and rows > 1
            mma = mma or (to == fastpath.DENSE and dense and rows >= dense_shadow.MIN_ROWS)
            mma = mma or (to == fastpath.DEQUANT and bool(large) and rows >= dequant_matmul.MIN_ROWS)
            if rows == 1 and not (to == 1 or kernel):
                raise ValueError(f"{shape}: one row planned to {to}")
            if rows > max_rows and not (mma or to == rows):
                raise ValueError(f"{shape}: {rows} rows planned to {to}")
            if not (kernel or mma or to == 0 or to == rows or (to in pads and to > rows)):
                raise ValueError(f"{shape}: {rows} rows planned to {to}")
        out[shape] = parsed
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """An exclusive lock on ``path``, waited for at most ``LOCK_WAIT_S``; yields whether it is held
    (a lock never released, say by a stuck process, must not stop the engine from starting). Where
    the platform has no ``fcntl`` there is none, and two processes starting at once may each time
    their own plans: the last one written is kept."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on a platform MLX serves from
        yield True
        return
    with path.open("a") as f:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def keep_check(
    root: Path,
    shapes: list[str],
    max_rows: int,
    pads: tuple[int, ...],
    check: dict[int, Any],
    large: tuple[int, ...] = (),
    dense: bool = False,
) -> None:
    """Beside the plans, what their whole-forward check measured (``plan_timing.forward_checked``'s
    report: each row count's forward milliseconds by candidate and the one kept), for reading only:
    ``load_or_time`` never reads it. Plans are timed once per machine, so this is the one record
    of why they are what they are."""
    path = root / f"{plan_key(shapes, max_rows, pads, large, dense)}.check.json"
    _write(path, json.dumps({str(rows): r for rows, r in sorted(check.items())}, indent=1), "their check")


def _write(path: Path, text: str, what: str) -> None:
    """``text`` into ``path`` whole (a reader never sees half a file); a folder that cannot be
    written is logged, not raised: the store only spares later processes the timing."""
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        log.warning("kernel plans: cannot keep %s in %s (%s)", what, path.parent, exc)


def load_or_time(
    root: Path | None,
    shapes: list[str],
    max_rows: int,
    pads: tuple[int, ...],
    time_plans: Callable[[], Plans],
    kernel_rows: int = 0,
    large: tuple[int, ...] = (),
    dense: bool = False,
) -> tuple[Plans, bool]:
    """The stored plans for these shapes, or ``time_plans()`` stored for the next process; returns
    the plans and whether they came from the store. ``root`` ``None``: always timed, never stored."""
    if root is None:
        return time_plans(), False
    path = root / f"{plan_key(shapes, max_rows, pads, large, dense)}.json"
    with contextlib.ExitStack() as stack:
        try:
            root.mkdir(parents=True, exist_ok=True)
            held = stack.enter_context(_locked(root / "plans.lock"))
        except OSError as exc:  # a cache folder that cannot be made or written: serve without a store
            log.warning("kernel plans: cannot use %s (%s); timing them in this process", root, exc)
            return time_plans(), False
        if not held:
            log.warning("kernel plans: %s stayed locked for %.0f s; timing them in this process", root, LOCK_WAIT_S)
            return time_plans(), False
        if path.exists():
            try:
                size = path.stat().st_size
                if size > MAX_FILE_BYTES:
                    raise ValueError(f"{size} bytes, more than plans take")
                plans = valid(json.loads(path.read_text()), shapes, max_rows, pads, kernel_rows, large, dense)
                return plans, True
            except Exception as exc:  # anything in the file, however odd, means "time again"
                log.warning("ignoring the stored kernel plans %s (%s); timing them again", path, exc)
        plans = time_plans()
        _write(path, json.dumps({sh: {str(r): t for r, t in p.items()} for sh, p in plans.items()}, indent=1), "them")
        return plans, False
