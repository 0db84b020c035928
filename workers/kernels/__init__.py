"""The kernels room: kernel levels and the wrappers that run a forward at one, the project's row kernels
and their plans, and the mlx-lm internals they patch. What the other rooms use of it is exported here.

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
- ``byte_equal``: byte equality, the one test of exactness;
- ``seam``: the test seam on every patched output;
- ``fastpath``, ``qmv_*``, ``gemv_rows``, ``sdpa_*``, ``rowkernel``, ``compiled_layers``, ``w4a16*``,
  ``dequant_*``, ``dense_shadow``, ``batch_attention``, ``plan_*``:
  the batched decode kernels and the plans that pick them;
- ``mlxlm``: the mlx-lm internals the engine reads (model classes, caches, detokenizers);
- ``backend``: what a measured fact depends on, and MLX's attention switch.

Tests inject divergences as ``seam.divergence_seam = fn`` and read ``seam.seam_call``.
"""

from __future__ import annotations

from workers.api import Level
from workers.kernels import compiled_layers, fastpath, mlxlm, plan_timing, qmv_launch, rowkernel
from workers.kernels.arrays import (
    as_float,
    as_int,
)
from workers.kernels.attention import (
    PerQueryCache,
    wrap_caches,
)
from workers.kernels.backend import (
    CUDNN_ATTENTION_ENV,
    SettingError,
    backend_fingerprint,
    configure_attention,
    configure_kernel_cache,
)
from workers.kernels.byte_equal import (
    bytes_equal,
    bytes_view,
)
from workers.kernels.calibration import (
    Probe,
    WidthReport,
    calibrate,
    measure_widths,
)
from workers.kernels.layout import (
    LAYOUT_STEP,
    stabilize_layout,
)
from workers.kernels.levels import (
    LADDER,
    current_level,
    in_scoped_pin,
    ladder,
    process_level,
    process_scope,
    scoped,
    set_process_level,
)
from workers.kernels.mlxlm import (
    continuation_bpe_class,
    detokenizer_prototype,
    merge_caches,
    model_classes,
)
from workers.kernels.patches import (
    install,
    stock,
)
from workers.kernels.plan_timing import drive
from workers.kernels.projections import (
    PAD_ROWS,
    CapturedCall,
    capturing,
)
from workers.kernels.seam import (
    SeamCall,
)
from workers.kernels.widths import (
    MAX_MEASURED_WIDTH,
    apply_widths,
    every_width_one,
    reset_widths,
    saved_widths,
    widths_by_path,
)
from workers.kernels.widths import (
    chunk_widths as _widths,
)
from workers.kernels.widths import (
    load_time_widths as _measured,
)

__all__ = [
    "CUDNN_ATTENTION_ENV",
    "CapturedCall",
    "LADDER",
    "LAYOUT_STEP",
    "Level",
    "MAX_MEASURED_WIDTH",
    "PAD_ROWS",
    "PerQueryCache",
    "Probe",
    "SeamCall",
    "SettingError",
    "WidthReport",
    "_measured",
    "_widths",
    "apply_widths",
    "as_float",
    "as_int",
    "backend_fingerprint",
    "bytes_equal",
    "bytes_view",
    "calibrate",
    "capturing",
    "compiled_layers",
    "configure_attention",
    "configure_kernel_cache",
    "continuation_bpe_class",
    "current_level",
    "detokenizer_prototype",
    "drive",
    "every_width_one",
    "fastpath",
    "in_scoped_pin",
    "install",
    "ladder",
    "measure_widths",
    "merge_caches",
    "mlxlm",
    "model_classes",
    "plan_timing",
    "process_level",
    "process_scope",
    "qmv_launch",
    "reset_widths",
    "rowkernel",
    "saved_widths",
    "scoped",
    "set_process_level",
    "stabilize_layout",
    "stock",
    "widths_by_path",
    "wrap_caches",
]
