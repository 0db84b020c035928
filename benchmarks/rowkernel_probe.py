"""Device measurement behind ``workers/rowkernel.py`` (run where MLX runs on CUDA).

    python benchmarks/rowkernel_probe.py --model /tmp/m8b --out rowkernel.json

1. Per projection shape of the model: the kernel against the plain-MLX reference (max abs error
   over max |reference|), row-exactness (each row of an M-row call byte-equal to the 1-row call),
   and milliseconds at M = 1, 2, 5, 8 against MLX's own quantized matmul at M = 1 and 5.
2. Whole model at B = 1 (context 300): a classic step and a 5-token block (K = 4) at wide, padded
   and rowwise, in milliseconds and in wide classic steps.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from fastpath_probe import timeit  # this folder is the script's first path entry
from mlx_lm.models.cache import make_prompt_cache

from workers import rowkernel
from workers.kernels import Level, install, scoped, stock, wrap_caches
from workers.models import load


def shapes(model: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seen: set[tuple[int, ...]] = set()
    for name, m in model.named_modules():
        if not isinstance(m, (nn.QuantizedLinear, nn.Linear)) or tuple(m.weight.shape) in seen:
            continue
        seen.add(tuple(m.weight.shape))
        d_in = m.weight.shape[-1] * 32 // m.bits if isinstance(m, nn.QuantizedLinear) else m.weight.shape[-1]
        x = mx.random.normal((8, d_in)).astype(mx.bfloat16)
        row: dict[str, Any] = {"shape": tuple(m.weight.shape)}
        kind, weights, extra = _kind(m)
        ref = rowkernel._reference(kind, x, weights, extra)
        got = rowkernel.project(m, x)
        if got is None:
            row["covered"] = False
            out[name] = row
            continue
        err = mx.max(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))) / mx.max(mx.abs(ref.astype(mx.float32)))
        row["rel_err"] = float(err.item())
        ones = [rowkernel.project(m, x[i : i + 1]) for i in range(8)]
        row["row_exact"] = {
            mm: all(
                bool(mx.array_equal(rowkernel.project(m, x[:mm])[i].view(mx.uint16), ones[i][0].view(mx.uint16)).item())  # type: ignore[index]
                for i in range(mm)
            )
            for mm in (2, 3, 5, 8)
        }
        row["kernel_ms"] = {
            mm: round(timeit(lambda mm=mm, m=m, x=x: rowkernel.project(m, x[:mm]), 20), 4) for mm in (1, 2, 5, 8)
        }
        with stock():
            row["mlx_ms"] = {mm: round(timeit(lambda mm=mm, m=m, x=x: m(x[:mm]), 20), 4) for mm in (1, 5)}
        print(name, json.dumps(row), flush=True)
        out[name] = row
    return out


def _kind(m: Any) -> tuple[str, tuple[mx.array, ...], dict[str, int]]:
    found = rowkernel._weights(m)
    assert found is not None
    kind, weights, _, extra = found
    return kind, weights, extra


def whole_model(model: nn.Module, vocab: int, context: int = 300) -> dict[str, Any]:
    prompt = mx.array([[(7 * i) % (vocab - 10) + 5 for i in range(context)]])

    def fresh() -> list[Any]:
        cache = make_prompt_cache(model)
        model(prompt, cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def step_ms(level: Level, tokens: int) -> float:
        times = []
        for rep in range(7):
            cache = fresh()
            block = mx.array([[11 + rep + j for j in range(tokens)]])
            tic = time.perf_counter()
            with scoped(level):
                c = wrap_caches(cache) if level.per_query and tokens > 1 else cache
                mx.eval(model(block, cache=c))
            times.append((time.perf_counter() - tic) * 1e3)
        return sorted(times[2:])[len(times[2:]) // 2]

    out: dict[str, Any] = {}
    for level in (Level.WIDE, Level.PADDED, Level.ROWWISE, Level.PER_QUERY_1):
        out[level.value] = {"step_ms": step_ms(level, 1), "block5_ms": step_ms(level, 5)}
        print(level.value, out[level.value], flush=True)
    base = out["wide"]["step_ms"]
    for v in out.values():
        v["step_in_wide_steps"] = round(v["step_ms"] / base, 3)
        v["block5_in_wide_steps"] = round(v["block5_ms"] / base, 3)
        v["block5_in_own_steps"] = round(v["block5_ms"] / v["step_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    install()
    print("implementation", rowkernel.implementation(), "usable", rowkernel.usable(), flush=True)
    loaded = load(a.model)
    report = {"usable": rowkernel.usable(), "shapes": shapes(loaded.model)}
    report["whole_model"] = whole_model(loaded.model, loaded.info.vocab_size)
    print(json.dumps(report["whole_model"], indent=1))
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
