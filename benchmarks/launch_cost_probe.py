"""Device measurement: what one custom-kernel call costs the host, against one MLX op (MLX CUDA).

    python benchmarks/launch_cost_probe.py --out launch.json

Why: on the H200 8B synth a mirrored 5-token verify block spends 9-11 ms building its graph against
2.5-3.5 ms for a classic step (docs/benchmarks.md section 23), while building five such blocks on the
CPU, with the kernel launches replaced by one MLX call each, makes only 1.8x a step's Python calls.
What this CPU cannot show is the host cost of ``mx.fast.cuda_kernel`` itself: MLX assembles the
kernel's source text on every call and hashes it when the graph is evaluated. Here N calls of a
trivial kernel (``out = x + 1``) with the project kernels' source length, and N calls of MLX's own
``x + 1``, are built and then evaluated, each chained on the previous output; printed: microseconds
a call to build, and to build and evaluate, for source texts of several lengths (the project's
kernels carry 3-9 KB). Exits 2 where MLX has no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def _time(call: Callable[[mx.array], mx.array]) -> dict[str, float]:
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
    print(json.dumps(report, indent=1))
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
