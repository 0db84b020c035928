"""Device measurement: what each part of a decoder layer adds to a decode step, by batch size (issue 15).

    python benchmarks/layer_parts_probe.py --model /tmp/m8b --out parts.json

``step_anatomy.py`` found the H200 8B synth's forward at B = 16 costing ~20 ms against ~8 at B = 1
while its projections alone cost ~7 against ~5 and attention ~0.4: most of the difference is in
neither. Here every layer of the model runs one decode row per sequence up to a stage (1: input
norm, 2: + q/k/v projections, 3: + reshapes and RoPE, 4: + cache update, 5: + attention, 6: + o
projection and residual, 7: + post norm and MLP, 8: + residual), all layers in one evaluation, so
the difference between consecutive stages is what that stage costs a step (milliseconds, median of
``REPS``; build = Python and graph building before evaluation). Each layer's input waits for the
previous layer's stage output (``_after``), as in a forward. Projections run as the engine runs
them (patched, with the plans calibration picks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import make_prompt_cache

from workers import fastpath, plan_timing
from workers.kernels import install
from workers.models import load

STAGES = ("norm", "qkv", "rope", "cache", "attention", "o+residual", "mlp", "residual")
REPS = 9


def stage(layer: nn.Module, x: mx.array, cache: Any, s: int) -> Any:
    b = x.shape[0]
    h = layer.input_layernorm(x)
    if s == 1:
        return h
    a = layer.self_attn
    q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
    if s == 2:
        return [q, k, v]
    q = a.rope(q.reshape(b, 1, a.n_heads, -1).transpose(0, 2, 1, 3), offset=cache.offset)
    k = a.rope(k.reshape(b, 1, a.n_kv_heads, -1).transpose(0, 2, 1, 3), offset=cache.offset)
    v = v.reshape(b, 1, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if s == 3:
        return [q, k, v]
    keys, values = cache.update_and_fetch(k, v)
    if s == 4:
        return [q, keys, values]
    o = scaled_dot_product_attention(q, keys, values, cache=cache, scale=a.scale, mask=None)
    if s == 5:
        return o
    r = x + a.o_proj(o.transpose(0, 2, 1, 3).reshape(b, 1, -1))
    if s == 6:
        return r
    m = layer.mlp(layer.post_attention_layernorm(r))
    if s == 7:
        return m
    return r + m


def _after(x: mx.array, out: Any) -> mx.array:
    """``x`` made to wait for ``out``: MLX CUDA runs kernels that share no data side by side, so
    layers run on one input time how many finish together, not a forward's chain of layers."""
    first = out[0] if isinstance(out, list) else out
    return x + (first.reshape(-1)[:1] * 0).astype(x.dtype)


def time_stage(model: nn.Module, b: int, s: int, context: int) -> tuple[float, float]:
    layers = model.model.layers
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 1000, (b, context)), cache=cache))
    x = (mx.random.normal((b, 1, layers[0].input_layernorm.weight.shape[0])) * 0.1).astype(mx.bfloat16)
    mx.eval(x)
    totals, builds = [], []
    for i in range(REPS + 3):
        mx.synchronize()
        tic = time.perf_counter()
        outs, h = [], x
        for layer, c in zip(layers, cache, strict=True):
            out = stage(layer, h, c, s)
            outs.append(out)
            h = _after(h, out)
        built = time.perf_counter()
        mx.eval(outs)
        if s >= 4:
            for c in cache:
                c.offset -= 1  # the same context every repetition
        if i >= 3:
            totals.append(time.perf_counter() - tic)
            builds.append(built - tic)
    return round(statistics.median(totals) * 1e3, 3), round(statistics.median(builds) * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=64)
    a = ap.parse_args()
    install()
    loaded = load(a.model)
    report: dict[str, Any] = {"plans": fastpath.plans_summary(plan_timing.calibrate(loaded.model)), "by_batch": {}}
    for b in (int(x) for x in a.batches.split(",")):
        row: dict[str, Any] = {}
        prev = 0.0
        for s, name in enumerate(STAGES, start=1):
            ms, build = time_stage(loaded.model, b, s, a.context)
            row[name] = {"cumulative_ms": ms, "adds_ms": round(ms - prev, 3), "build_ms": build}
            prev = ms
        report["by_batch"][b] = row
        print(b, json.dumps({k: (v["cumulative_ms"], v["adds_ms"], v["build_ms"]) for k, v in row.items()}), flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
