"""Kernel levels, one import: what the engine, the probe, the benchmarks and the tests use of them.

The pieces, each in its own module:

- ``levels``: the levels, the ladder's order on this backend, and which level is in force
  (``scoped`` around one forward, or the process-wide pin);
- ``projections``: the projection wrapper that runs a pinned forward's rows as its level says
  (chunked, padded, row-exact), and the capture of its calls for calibration;
- ``attention``: per-query attention through the cache's own update path;
- ``patches``: installing (and taking off) those wrappers on MLX and mlx-lm;
- ``widths`` and ``calibration``: each projection's row-exact width, measured at load and
  calibrated by the probe;
- ``layout``: one cache layout through a draw or a burst;
- ``exact``: byte equality;
- ``seam``: the test seam on every patched output.

Tests inject divergences as ``seam.divergence_seam = fn`` and read ``seam.seam_call``.
"""

from __future__ import annotations

from workers.attention import PerQueryCache, wrap_caches
from workers.calibration import Probe, WidthReport, calibrate, measure_widths
from workers.exact import bytes_equal, bytes_view
from workers.layout import LAYOUT_STEP, stabilize_layout
from workers.levels import (
    LADDER,
    Level,
    current_level,
    in_scoped_pin,
    ladder,
    process_level,
    process_scope,
    scoped,
    set_process_level,
)
from workers.patches import install, stock
from workers.projections import PAD_ROWS, CapturedCall, capturing
from workers.seam import SeamCall
from workers.widths import (
    MAX_MEASURED_WIDTH,
    apply_widths,
    every_width_one,
    reset_widths,
    saved_widths,
    widths_by_path,
)
from workers.widths import chunk_widths as _widths
from workers.widths import load_time_widths as _measured

__all__ = [
    "LADDER",
    "LAYOUT_STEP",
    "MAX_MEASURED_WIDTH",
    "PAD_ROWS",
    "CapturedCall",
    "Level",
    "PerQueryCache",
    "Probe",
    "SeamCall",
    "WidthReport",
    "_measured",
    "_widths",
    "apply_widths",
    "bytes_equal",
    "bytes_view",
    "calibrate",
    "capturing",
    "current_level",
    "every_width_one",
    "in_scoped_pin",
    "install",
    "ladder",
    "measure_widths",
    "process_level",
    "process_scope",
    "reset_widths",
    "saved_widths",
    "scoped",
    "set_process_level",
    "stabilize_layout",
    "stock",
    "widths_by_path",
    "wrap_caches",
]
