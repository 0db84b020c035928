"""Write MLX's embedded CUDA JIT device headers (its ``jit_source_*`` strings) out of libmlx.so, under
the names NVRTC includes them by (``workers.kernels.mlx_jit.embedded_headers`` reads them)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from workers.kernels.mlx_jit import embedded_headers  # noqa: E402

lib = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mlxcuda/mlx/lib/libmlx.so")
out = Path(
    sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.environ.get("NVRTC_WORK", "/tmp/nvrtc"), "jit_headers")
)
for name, blob in embedded_headers(lib).items():
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).write_bytes(blob)
    print(name, len(blob))
