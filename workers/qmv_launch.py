"""The launch settings of ``workers.qmv_rows``' kernel by row count: outputs per warp, warps per block
and weight tiles loaded ahead.

Why a module of its own: the settings are measured per machine (``benchmarks/qmv_variants_probe.py``,
``rowkernel_probe.py``) and overridable from the environment, and the kernel plans timed on them
(``plan_store``, the bench's JSON) record them (``variant``). None of them changes a byte: every output
keeps its operations and their order whatever the setting; only how the work is laid over the GPU
changes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger("mlx_batchd.qmv_rows")

#: Rows per kernel call (a longer block runs in calls of this many; each row is unaffected).
MAX_ROWS = 8
#: Warps per block (``BLOCK_WARPS`` by row count over it).
WARPS = 8
#: Output features per warp. Any value gives every output the same operations in the same order
#: (only how x is fetched changes); larger values share each x tile between outputs. On the H200 8B
#: synth every layer shape and the head were byte-equal to MLX's one-row call at 1, 5 and 8 rows for
#: 1, 2 and 4 outputs per warp, and 4 was the fastest at 5 rows (docs/benchmarks.md section 12).
OUTS_PER_WARP = 4
#: Row counts that run fewer outputs per warp. A lane keeps one tile of accumulators (8 registers for
#: 4-bit) per output and row, so R outputs on M rows hold 8 R M registers: 256 at 4 outputs on 8 rows,
#: the whole register file. On the H200 (docs/benchmarks.md section 25: each call timed alone over an
#: 8B layer's shapes, weights read from HBM, the kernel's 16-byte loads): at 1 row 2 outputs per warp
#: in 4-warp blocks took 100.7 us a layer against 112.3 at 4 outputs in 8-warp blocks; at 8 rows 2
#: outputs in 4-warp blocks 240.3 against 255.4 in 8-warp blocks; at 4 and 5 rows 4 outputs in 8-warp
#: blocks were the fastest. 6 and 7 rows (unmeasured) follow 8's register count.
FEWER_OUTS = {1: 2, 6: 2, 7: 2, 8: 2}
#: Row counts that run smaller blocks than ``WARPS`` (same measurements as ``FEWER_OUTS``).
SMALLER_BLOCKS = {1: 4, 6: 4, 7: 4, 8: 4}


def _by_rows(env: str, defaults: dict[int, int], ok: Callable[[int], bool]) -> dict[int, int]:
    """A launch setting by row count: ``defaults`` with the environment variable ``env`` over it, one
    number for every row count (``"2"``) or ``rows:value`` pairs (``"1:4,5:2"``). For measuring which
    suits which row count: every setting gives the same bytes."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return dict(defaults)
    try:
        if ":" not in raw:
            pairs = [(rows, int(raw)) for rows in range(1, MAX_ROWS + 1)]
        else:
            pairs = [(int(a), int(b)) for a, b in (item.split(":") for item in raw.split(","))]
        if all(1 <= rows <= MAX_ROWS and ok(v) for rows, v in pairs):
            return {**defaults, **dict(pairs)}
    except ValueError:
        pass
    log.warning("%s=%r: not a value or rows:value pairs in range; using the defaults", env, raw)
    return dict(defaults)


def _per_warp() -> dict[int, int]:
    return _by_rows("MLX_BATCHD_QMV_PER_WARP", FEWER_OUTS, lambda v: 1 <= v <= 8)


#: Row count -> outputs per warp where it is not ``OUTS_PER_WARP`` (``MLX_BATCHD_QMV_PER_WARP``).
PER_WARP = _per_warp()


#: Row count -> warps per block where it is not ``WARPS`` (``MLX_BATCHD_QMV_WARPS``): smaller blocks let
#: an SM hold more of them when each thread needs many registers.
def _block_warps() -> dict[int, int]:
    return _by_rows("MLX_BATCHD_QMV_WARPS", SMALLER_BLOCKS, lambda v: v in (1, 2, 4, 8, 16))


BLOCK_WARPS = _block_warps()


def per_warp(rows: int) -> int:
    """Outputs per warp of a call on ``rows`` rows."""
    return PER_WARP.get(rows, OUTS_PER_WARP)


def warps(rows: int) -> int:
    """Warps per block of a call on ``rows`` rows."""
    return BLOCK_WARPS.get(rows, WARPS)


def variant() -> str:
    """The kernel's launch settings as one line (part of what kernel plans timed on it depend on):
    rows:outputs per warp/warps per block, then the tiles loaded ahead."""
    shapes = (f"{rows}:{per_warp(rows)}/{warps(rows)}" for rows in range(1, MAX_ROWS + 1))
    return " ".join(shapes) + f" u{UNROLL}"


#: Loop iterations whose weight tiles a lane loads before using the first of them (memory-level
#: parallelism: one tile at a time leaves each warp waiting on one load). Any value gives every
#: output the same operations in the same order. ``MLX_BATCHD_QMV_UNROLL`` overrides it (benchmarks).
def _unroll() -> int:
    raw = os.environ.get("MLX_BATCHD_QMV_UNROLL", "")
    if raw.strip().isdigit() and 1 <= int(raw) <= 8:
        return int(raw)
    if raw:
        log.warning("MLX_BATCHD_QMV_UNROLL=%r: expected 1..8; using 1", raw)
    return 1


UNROLL = _unroll()
