"""The launch settings of ``workers.kernels.qmv_rows``' kernel by row count: outputs per warp, warps per block
and weight tiles loaded ahead.

Why a module of its own: the settings are measured per machine (``benchmarks/qmv_variants_probe.py``,
``rowkernel_probe.py``) and fixed here from those measurements, and the kernel plans timed on them
(``plan_store``, the bench's JSON) record them (``variant``). None of them changes a byte: every output
keeps its operations and their order whatever the setting; only how the work is laid over the GPU
changes.
"""

from __future__ import annotations

#: Rows per kernel call (a longer block runs in calls of this many; each row is unaffected). Declared
#: with the settings the front end reads (an MTP head's default K is one less).
from workers.api import MAX_ROWS as MAX_ROWS

#: Warps per block (``BLOCK_WARPS`` by row count over it).
WARPS = 8
#: Output features per warp. Any value gives every output the same operations in the same order
#: (only how x is fetched changes); larger values share each x tile between outputs. 4 was the
#: fastest at 5 rows, a verify block's size (``benchmarks/qmv_variants_probe.py`` measures it).
OUTS_PER_WARP = 4
#: Row counts that run fewer outputs per warp. A lane keeps one tile of accumulators (8 registers for
#: 4-bit) per output and row, so R outputs on M rows hold 8 R M registers: 256 at 4 outputs on 8 rows,
#: the whole register file. Measured over an 8B layer's shapes (``benchmarks/qmv_variants_probe.py``):
#: at 1 and 8 rows 2 outputs per warp in 4-warp blocks were the fastest, at 4 and 5 rows 4 outputs in
#: 8-warp blocks. 6 and 7 rows (unmeasured) follow 8's register count.
FEWER_OUTS = {1: 2, 6: 2, 7: 2, 8: 2}
#: Row counts that run smaller blocks than ``WARPS`` (same measurements as ``FEWER_OUTS``).
SMALLER_BLOCKS = {1: 4, 6: 4, 7: 4, 8: 4}


#: Row count -> outputs per warp where it is not ``OUTS_PER_WARP``.
PER_WARP = dict(FEWER_OUTS)
#: Row count -> warps per block where it is not ``WARPS``: smaller blocks let an SM hold more of them
#: when each thread needs many registers.
BLOCK_WARPS = dict(SMALLER_BLOCKS)


def per_warp(rows: int) -> int:
    """Outputs per warp of a call on ``rows`` rows."""
    return PER_WARP.get(rows, OUTS_PER_WARP)


def warps(rows: int) -> int:
    """Warps per block of a call on ``rows`` rows."""
    return BLOCK_WARPS.get(rows, WARPS)


def unroll(rows: int) -> int:
    """Weight tiles a lane loads ahead in a call on ``rows`` rows."""
    return AHEAD.get(rows, UNROLL)


def variant() -> str:
    """The kernel's launch settings as one line (part of what kernel plans timed on it depend on):
    rows:outputs per warp/warps per block/tiles loaded ahead."""
    return " ".join(f"{rows}:{per_warp(rows)}/{warps(rows)}/{unroll(rows)}" for rows in range(1, MAX_ROWS + 1))


#: Loop iterations whose weight tiles a lane loads before using the first of them (memory-level
#: parallelism: one tile at a time leaves each warp waiting on one load). Any value gives every
#: output the same operations in the same order.
UNROLL = 1
#: Row counts that load another number of tiles ahead than ``UNROLL``.
AHEAD: dict[int, int] = {}
