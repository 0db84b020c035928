"""Device measurements behind ``workers/kernels/fastpath.py``'s policies (run on the machine being tuned).

    python benchmarks/fastpath_probe.py --model "$M" --out results.json

1. Quantized projection cost by row count M (2-D input), to place the padding bands.
2. Whole-model decode step by B under each policy (``off`` = stock mlx-lm, ``generic`` = flattened
   rows, ``cuda`` = flattened + padded rows + contiguous K/V).
3. Fused attention over the cache's strided views vs a contiguous copy (copy included).
4. Reproducibility of classic B = 1 decode: the same teacher-forced chain run twice, per policy;
   positions whose logits differ in any byte.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from workers.kernels import bytes_view, fastpath, stock
from workers.models.loading import load


def timeit(f: Callable[[], Any], n: int = 10) -> float:
    for _ in range(3):
        mx.eval(f())
    mx.synchronize()
    tic = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    mx.synchronize()
    return (time.perf_counter() - tic) / n * 1e3


def projection_costs(model: nn.Module) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    seen: set[tuple[int, ...]] = set()
    for name, m in model.named_modules():
        if not isinstance(m, nn.QuantizedLinear) or tuple(m.weight.shape) in seen:
            continue
        seen.add(tuple(m.weight.shape))
        d_in = m.weight.shape[-1] * 32 // m.bits
        row: dict[int, float] = {}
        for rows in [*range(1, 25), 28, 32, 48, 64, 96, 128]:
            x = mx.random.normal((rows, d_in)).astype(mx.bfloat16)
            with stock():
                row[rows] = round(timeit(lambda x=x, m=m: m(x), 20), 4)
        out[f"{name} {tuple(m.weight.shape)}"] = row
    return out


def decode_steps(model: nn.Module, batches: list[int], context: int) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for policy in (fastpath.OFF, fastpath.GENERIC, fastpath.CUDA):
        fastpath.set_active(policy)
        scope = stock if policy is fastpath.OFF else contextlib.nullcontext
        row: dict[int, float] = {}
        for b in batches:
            cache = make_prompt_cache(model)
            mx.eval(model(mx.random.randint(0, 1000, (b, context)), cache=cache))
            y = mx.random.randint(0, 1000, (b, 1))

            def step(y: mx.array = y, cache: list[Any] = cache) -> mx.array:
                out = model(y, cache=cache)[:, -1]
                for c in cache:
                    c.offset -= 1  # stay at the same context: time one step shape, many times
                return out

            with scope():
                row[b] = round(timeit(step, 10), 3)
        out[policy.name] = row
    fastpath.set_active(None)
    return out


def _sdpa(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.08)


def attention_costs() -> dict[str, float]:
    out: dict[str, float] = {}
    heads, kv_heads, dim = 32, 8, 128
    for b in (1, 8, 32, 64):
        for ctx in (128, 1024, 4096):
            buf = mx.random.normal((b, kv_heads, ctx + 256, dim)).astype(mx.bfloat16)
            k = buf[:, :, :ctx]
            v = buf[:, :, :ctx]
            q = mx.random.normal((b, heads, 1, dim)).astype(mx.bfloat16)
            out[f"B{b} ctx{ctx} strided"] = round(timeit(lambda q=q, k=k, v=v: _sdpa(q, k, v), 20), 4)
            out[f"B{b} ctx{ctx} contiguous+copy"] = round(
                timeit(lambda q=q, k=k, v=v: _sdpa(q, mx.contiguous(k), mx.contiguous(v)), 20), 4
            )
    return out


def chain_repro(model: nn.Module, steps: int) -> dict[str, Any]:
    """Positions whose logits differ between two identical teacher-forced B = 1 chains."""
    tokens = mx.random.randint(0, 1000, (steps + 8,), key=mx.random.key(3)).tolist()
    out: dict[str, Any] = {}
    for policy in (fastpath.OFF, fastpath.CUDA):
        fastpath.set_active(policy)
        runs = []
        scope = stock if policy is fastpath.OFF else contextlib.nullcontext
        for _ in range(2):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([tokens[:8]]), cache=cache))
            rows = []
            tic = time.perf_counter()
            with scope():
                for t in tokens[8 : 8 + steps]:
                    logits = model(mx.array([[t]]), cache=cache)[0, -1]
                    mx.eval(logits)
                    rows.append(logits)
            ms = (time.perf_counter() - tic) / steps * 1e3
            runs.append((rows, ms))
        differ = [
            i
            for i, (a, b) in enumerate(zip(runs[0][0], runs[1][0]))
            if not bool(mx.all(bytes_view(a) == bytes_view(b)).item())
        ]
        out[policy.name] = {
            "differing_positions": len(differ),
            "first": differ[0] if differ else None,
            "step_ms": round(runs[1][1], 3),
        }
    fastpath.set_active(None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,2,4,8,12,16,24,32,64,128")
    ap.add_argument("--chain-steps", type=int, default=600)
    args = ap.parse_args()
    loaded = load(args.model)
    model = loaded.model
    result: dict[str, Any] = {"device": str(mx.default_device()), "detected_policy": fastpath.detect().name}
    print("projections", flush=True)
    result["projection_ms_by_rows"] = projection_costs(model)
    print("decode steps", flush=True)
    result["decode_step_ms"] = decode_steps(model, [int(b) for b in args.batches.split(",")], 64)
    print(json.dumps(result["decode_step_ms"]), flush=True)
    print("attention", flush=True)
    result["attention_ms"] = attention_costs()
    print("chain reproducibility", flush=True)
    result["chain"] = chain_repro(model, args.chain_steps)
    print(json.dumps(result["chain"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
