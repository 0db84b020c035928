"""Whether the dense mirrored kernel (``workers/kernels/gemv_rows.py``) reproduces MLX's one-row ``gemv`` on a
model's shapes, and what a ``mirrored`` verify block costs with it, in classic steps (issue 14).

    python benchmarks/gemv_rows_check.py --model demo --out gemv.json

Prints and writes: each weight shape's check (byte-equal to MLX's one-row call, or not), and the
median milliseconds of a classic one-token forward and of K + 1-token blocks at ``mirrored`` with the
kernel and with it off (decode's one-row call per row), each after a 64-token prompt, forwards
evaluated one at a time. Needs MLX CUDA for the kernel; elsewhere every row takes the one-row call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from workers import kernels
from workers.api import Level
from workers.kernels import gemv_rows, scoped
from workers.models.loading import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--blocks", default="3,5,9", help="block lengths (K + 1), comma-separated")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    kernels.install()
    model = load(a.model).model
    prompt = mx.array([[(5 * i) % 200 + 3 for i in range(64)]])

    def ms(tokens: int, level: Level) -> float:
        times = []
        for rep in range(9):
            cache = make_prompt_cache(model)
            mx.eval(model(prompt, cache=cache))
            block = mx.array([[7 + rep + j for j in range(tokens)]])
            tic = time.perf_counter()
            with scoped(level):
                mx.eval(model(block, cache=kernels.wrap_caches(cache) if tokens > 1 else cache))
            times.append(1e3 * (time.perf_counter() - tic))
        return statistics.median(times[2:])

    report: dict[str, Any] = {"step_ms": ms(1, Level.WIDE), "blocks": {}}
    for t in (int(b) for b in a.blocks.split(",")):
        with_kernel = ms(t, Level.MIRRORED)
        saved, gemv_rows._compiled = gemv_rows._compiled, False
        one_row = ms(t, Level.MIRRORED)
        gemv_rows._compiled = saved
        report["blocks"][t] = {
            "kernel_ms": with_kernel,
            "one_row_calls_ms": one_row,
            "kernel_in_steps": round(with_kernel / report["step_ms"], 3),
            "one_row_calls_in_steps": round(one_row / report["step_ms"], 3),
        }
    report["shapes"] = gemv_rows.report()
    print(json.dumps(report, indent=1))
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
