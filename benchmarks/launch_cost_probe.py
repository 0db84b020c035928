"""Device measurement: what one custom-kernel call costs the host, against one MLX op (MLX CUDA).

    python benchmarks/launch_cost_probe.py --out launch.json

Why: on the H200 8B synth a mirrored 5-token verify block spends 9-11 ms building its graph against
2.5-3.5 ms for a classic step (H200, 2026-12-03), while building five such blocks on the
CPU, with the kernel launches replaced by one MLX call each, makes only 1.8x a step's Python calls.
What this CPU cannot show is the host cost of ``mx.fast.cuda_kernel`` itself: MLX assembles the
kernel's source text on every call and hashes it when the graph is evaluated. Here N calls of a
trivial kernel (``out = x + 1``) with the project kernels' source length, and N calls of MLX's own
``x + 1``, are built and then evaluated, each chained on the previous output; printed: microseconds
a call to build, and to build and evaluate, for source texts of several lengths (the project's
kernels carry 3-9 KB); the same trivial kernel compiled ahead to PTX (``nvcc``, where the machine has
it) and run through ``mx.fast.precompiled_cuda_kernel`` (no source assembled per call); and the
project's own calls as a 5-token verify makes them against MLX's: ``qmv_rows`` over one 4096x4096
4-bit matrix and over three (q/k/v in one call) against MLX's quantized matmul, ``sdpa_rows`` against
MLX's fused attention. Exits 2 where MLX has no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

#: Calls per timed graph, and timed graphs per arm (median kept).
CALLS = 200
ROUNDS = 7
#: Source lengths (bytes of padding comments) around the trivial body.
PADDINGS = (0, 3000, 9000)

BODY = """
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < static_cast<int>(x_shape[0])) out[i] = static_cast<T>(static_cast<float>(x[i]) + 1.0f);
"""


def _kernel(padding: int) -> Callable[[mx.array], mx.array]:
    source = ("// " + "x" * 96 + "\n") * (padding // 100) + BODY
    kernel = mx.fast.cuda_kernel(name=f"launch_probe_{padding}", input_names=["x"], output_names=["out"], source=source)

    def call(x: mx.array) -> mx.array:
        return kernel(
            inputs=[x],
            template=[("T", x.dtype)],
            grid=(x.shape[0], 1, 1),  # threads in all, as MLX's custom kernels count them
            threadgroup=(min(256, x.shape[0]), 1, 1),
            output_shapes=[x.shape],
            output_dtypes=[x.dtype],
        )[0]

    return call


PTX_SOURCE = """
#include <cuda_bf16.h>
extern "C" __global__ void launch_probe_ptx(const __nv_bfloat16* x, __nv_bfloat16* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = __float2bfloat16(__bfloat162float(x[i]) + 1.0f);
}
"""


def _precompiled() -> Callable[[mx.array], mx.array] | None:
    """The trivial kernel compiled ahead by ``nvcc`` to PTX, run through ``precompiled_cuda_kernel``;
    ``None`` where there is no ``nvcc`` or MLX lacks the call."""
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc is None or not hasattr(mx.fast, "precompiled_cuda_kernel"):
        return None
    with tempfile.TemporaryDirectory() as d:
        src = f"{d}/k.cu"
        with open(src, "w") as f:
            f.write(PTX_SOURCE)
        subprocess.run([nvcc, "-ptx", "-arch=sm_90", "-o", f"{d}/k.ptx", src], check=True)
        with open(f"{d}/k.ptx", "rb") as f:
            ptx = f.read()

    def call(x: mx.array) -> mx.array:
        return mx.fast.precompiled_cuda_kernel(
            name="launch_probe_ptx",
            compiled_source=ptx,
            inputs=[x],
            output_shapes=[x.shape],
            output_dtypes=[x.dtype],
            scalars=[int(x.shape[0])],
            grid=(x.shape[0], 1, 1),
            threadgroup=(min(256, x.shape[0]), 1, 1),
        )[0]

    return call


def _project_arms() -> dict[str, Any]:
    """Build/eval microseconds a call of the project's kernels against MLX's, on a verify's shapes."""
    from workers.kernels import qmv_rows, sdpa_rows

    k = 4096
    mats = []
    for seed in range(3):
        w = (mx.random.normal((k, k), key=mx.random.key(seed)) * 0.02).astype(mx.bfloat16)
        mats.append(mx.quantize(w, group_size=64, bits=4))
    mx.eval(mats)
    w, s, b = mats[0]
    x = mx.random.normal((5, k)).astype(mx.bfloat16)
    q = mx.random.normal((1, 32, 5, 128)).astype(mx.bfloat16)
    keys = mx.random.normal((1, 8, 305, 128)).astype(mx.bfloat16)
    mx.eval(x, q, keys)
    calls: dict[str, tuple[Callable[[mx.array], mx.array], mx.array]] = {
        "mlx_quantized_matmul_5rows": (lambda y: mx.quantized_matmul(y, w, s, b, True, 64, 4), x),
        "qmv_rows_5rows_1mat": (lambda y: qmv_rows._launch(y, [(w, s, b)], 4, 64)[0], x),
        "qmv_rows_5rows_3mats": (lambda y: qmv_rows._launch(y, mats, 4, 64)[0], x),
        "mlx_sdpa_5queries": (
            lambda y: mx.fast.scaled_dot_product_attention(y, keys, keys, scale=0.088, mask="causal"),
            q,
        ),
        "sdpa_rows_5queries": (lambda y: sdpa_rows.attend(y, keys, keys, 0.088), q),
    }
    arms: dict[str, Any] = {}
    for name, (call, start) in calls.items():
        try:
            arms[name] = _time(call, start)
        except Exception as exc:  # one arm failing keeps the others' figures
            arms[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, arms[name], flush=True)
    return arms


def _time(call: Callable[[mx.array], mx.array], x: mx.array | None = None) -> dict[str, float]:
    if x is None:
        x = mx.zeros((1024,), dtype=mx.bfloat16)
    mx.eval(call(x))
    builds, totals = [], []
    for _ in range(ROUNDS):
        mx.synchronize()
        tic = time.perf_counter()
        y = x
        for _ in range(CALLS):
            y = call(y)
        built = time.perf_counter()
        mx.eval(y)
        done = time.perf_counter()
        builds.append((built - tic) / CALLS * 1e6)
        totals.append((done - tic) / CALLS * 1e6)
    return {"build_us": statistics.median(builds), "build_and_eval_us": statistics.median(totals)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not mx.cuda.is_available():
        print("launch_cost_probe: MLX has no CUDA device here")
        return 2
    report: dict[str, Any] = {"calls": CALLS, "mlx_add": _time(lambda y: y + 1)}
    for padding in PADDINGS:
        report[f"cuda_kernel_{padding}B"] = _time(_kernel(padding))
    pre = _precompiled()
    if pre is not None:
        report["precompiled_ptx"] = _time(pre)
    report.update(_project_arms())
    print(json.dumps(report, indent=1))
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
