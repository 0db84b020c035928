"""Host-side cost of building a verify block's graph at ``mirrored`` (issue 14), runnable on the CPU.

    python benchmarks/verify_build_probe.py

On the H200 half of a 5-token mirrored verify was graph building in Python (docs/benchmarks.md
section 16). Building does not depend on the backend's kernels, so this measures it here: a 32-layer
4-bit llama of small width, the CUDA kernel policy forced, and the CUDA launch of the mirrored kernel
replaced by a stand-in (MLX's own quantized matmul, called with the kernel's own arguments: named as
such, since the kernel cannot run on a CPU). Prints the median build milliseconds of a classic step, a wide 5-token block and a mirrored
one, and the Python function calls of building five mirrored blocks (deterministic, unlike this
machine's timings). ``--attention per-query`` builds attention as on the H200 before ``sdpa_rows``
(one MLX call per query: MLX CUDA sends grouped queries to cuDNN), ``kernel`` through the project's
block kernel (the kernel replaced by a stand-in of one MLX call, since it cannot run on a CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from workers import attention, fastpath, kernels, qmv_rows, rowkernel, sdpa_rows
from workers.kernels import Level, scoped, wrap_caches
from workers.models import load
from workers.synthetic import llama_config, write_model


def _qmv_stand_in(count: int) -> Any:
    """Stand-in for ``qmv_rows``' CUDA kernel over ``count`` matrices (named as such: it cannot run on
    a CPU): called with the kernel's own arguments, it makes one MLX quantized matmul per matrix."""

    def call(*, inputs: list[mx.array], template: list[tuple[str, Any]], **_: Any) -> list[mx.array]:
        t = dict(template)
        x = inputs[0]
        return [
            mx.quantized_matmul(x, inputs[1 + 3 * j], inputs[2 + 3 * j], inputs[3 + 3 * j], True, t["GS"], t["BITS"])
            for j in range(count)
        ]

    return call


def _sdpa_stand_in(name: str) -> Any:
    """Stand-in for ``sdpa_rows``' one-pass CUDA kernel: one MLX call in its place, its output laid
    out as the kernel lays it out."""

    def call(*, inputs: list[mx.array], **_: Any) -> list[mx.array]:
        q, k, v, s = inputs
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal") * s.astype(q.dtype)
        return [out.transpose(0, 2, 1, 3)]

    return call


def _calls(model: Any, fresh: Any, level: Level, tokens: list[int]) -> pstats.Stats:
    """The Python calls of building five forwards of ``tokens`` at ``level`` (deterministic)."""
    caches = [fresh() for _ in range(5)]
    profile = cProfile.Profile()
    profile.enable()
    for cache in caches:
        with scoped(level):
            model(mx.array([tokens]), cache=wrap_caches(cache) if level.per_query and len(tokens) > 1 else cache)
    profile.disable()
    return pstats.Stats(profile)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", choices=("per-query", "kernel"), default="per-query")
    ap.add_argument("--top", type=int, default=0, help="also print the N functions with the most own time")
    a = ap.parse_args()
    width = (1, False) if a.attention == "per-query" else (attention.MAX_GROUP, True)
    attention.group_width = lambda *_: width  # type: ignore[assignment]
    sdpa_rows._kernel = _sdpa_stand_in  # type: ignore[assignment]
    rowkernel.implementation = lambda: "cuda"  # type: ignore[assignment]
    qmv_rows._kernel = _qmv_stand_in  # type: ignore[assignment]
    fastpath.set_active(fastpath.CUDA)
    kernels.install()
    path = Path(tempfile.mkdtemp()) / "m32"
    write_model(path, llama_config(hidden=256, layers=32, ffn=512, heads=8, kv_heads=2, quant_bits=4), seed=1)
    model = load(str(path)).model
    qmv_rows.register_siblings(model)
    prompt = mx.array([[(7 * i) % 200 + 5 for i in range(12)]])

    def fresh() -> list[Any]:
        cache = make_prompt_cache(model)
        mx.eval(model(prompt, cache=cache), [c.state for c in cache])
        return cache

    def build(level: Level, tokens: int) -> float:
        cache = fresh()
        tic = time.perf_counter()
        with scoped(level):
            out = model(
                mx.array([[11 + j for j in range(tokens)]]),
                cache=wrap_caches(cache) if level.per_query and tokens > 1 else cache,
            )
        built = time.perf_counter() - tic
        mx.eval(out)
        return built

    for level, tokens in ((Level.WIDE, 1), (Level.WIDE, 5), (Level.MIRRORED, 5)):
        build(level, tokens)
        ms = statistics.median(build(level, tokens) for _ in range(9)) * 1e3
        print(f"{level.value} {tokens}-token build: {ms:.2f} ms")
    step_calls = _calls(model, fresh, Level.WIDE, [11])
    print("python calls building five wide one-token steps:", step_calls.total_calls)
    stats = _calls(model, fresh, Level.MIRRORED, [11, 12, 13, 14, 15])
    print("python calls building five mirrored 5-token blocks:", stats.total_calls)
    if a.top:
        stats.sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
