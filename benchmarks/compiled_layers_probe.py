"""Device measurement: batched decode with the decoder layers compiled around attention, against plain (issue 15).

    python benchmarks/compiled_layers_probe.py --model "$M" --out compiled.json

For each B: the engine's decode step (``Engine.step``, steps overlapping as in serving), milliseconds
a step, median of 24 steps, in arms alternating plain / compiled / plain / compiled on one engine
(``MLX_BATCHD_COMPILED_LAYERS`` as a policy switch); the model's synchronous forward with the graph's
build time beside it; and whether the compiled step's logits equal the plain step's byte for byte
over 12 decode steps (batched decode makes no byte promise on the GPU; this says whether fusion moved
any), with the largest difference where they do not. A plot of the steps and building beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache

from workers.api import Job
from workers.engine.engine import Engine
from workers.kernels import fastpath, install
from workers.kernels.byte_equal import bytes_equal
from workers.models.loading import load

STEPS = 24


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def policy(compiled: bool) -> None:
    fastpath.set_active(replace(fastpath.detect(), compiled_layers=compiled))


def engine_ms(engine: Engine, b: int) -> float:
    for i in range(b):
        engine.submit(Job(seq=i, prompt=[(7 * i + j) % 1000 + 3 for j in range(32)], max_tokens=400))
    for _ in range(8):  # prefill, the plain step that precedes tracing, the traces
        engine.step()
    samples = []
    for _ in range(STEPS):
        tic = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - tic)
    engine.cancel_all("cancelled")
    for _ in range(3):
        engine.step()
    return _ms(samples)


def forward(model: nn.Module, b: int, steps: int) -> tuple[list[mx.array], float, float]:
    """Logits of ``steps`` greedy decode steps after a 48-token prompt; median sync ms and build ms."""
    cache = [BatchKVCache([0] * b) for _ in model.layers]
    prompt = mx.array([[(5 * i + j) % 900 + 3 for j in range(48)] for i in range(b)])
    y = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)[:, None]
    mx.eval(y)
    logits, totals, builds = [], [], []
    for _ in range(steps):
        mx.synchronize()
        tic = time.perf_counter()
        out = model(y, cache=cache)[:, -1]
        built = time.perf_counter()
        mx.eval(out)
        totals.append(time.perf_counter() - tic)
        builds.append(built - tic)
        logits.append(out)
        y = mx.argmax(out, axis=-1)[:, None]
    return logits, _ms(totals[2:]), _ms(builds[2:])


def plot(report: dict[str, Any], path: str) -> None:
    """Engine step and graph building by B, plain against compiled (each arm's samples as whiskers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {int(b): row for b, row in report["by_batch"].items()}  # JSON keys are strings
    bs = sorted(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, style in (("plain", "o-"), ("compiled", "s-")):
        runs = [rows[b][f"engine_{arm}_ms"] for b in bs]
        mid = [statistics.median(r) for r in runs]
        err = [[m - min(r) for m, r in zip(mid, runs)], [max(r) - m for m, r in zip(mid, runs)]]
        ax.errorbar(bs, mid, yerr=err, fmt=style, capsize=3, label=f"engine step, {arm}")
        builds = [rows[b][f"build_{arm}_ms"] for b in bs]
        ax.plot(bs, builds, style.replace("-", ":"), label=f"graph building, {arm}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences (B)")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title("batched decode step, layers compiled around attention")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="2,4,8,16,32")
    a = ap.parse_args()
    install()
    loaded = load(a.model)
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size, max_batch=64)
    report: dict[str, Any] = {"layers_registered": engine.compiled_layers, "plans": engine.kernel_plans, "by_batch": {}}
    for b in (int(x) for x in a.batches.split(",")):
        row: dict[str, Any] = {}
        for arm in ("plain", "compiled", "plain", "compiled"):
            policy(arm == "compiled")
            row.setdefault(f"engine_{arm}_ms", []).append(engine_ms(engine, b))
        outs = {}
        for arm in ("plain", "compiled"):
            policy(arm == "compiled")
            logits, sync_ms, build_ms = forward(loaded.model, b, 12)
            outs[arm] = logits
            row[f"forward_{arm}_ms"], row[f"build_{arm}_ms"] = sync_ms, build_ms
        pairs = list(zip(outs["plain"], outs["compiled"], strict=True))
        row["logits_equal"] = [bytes_equal(p, c) for p, c in pairs]
        row["max_abs_diff"] = max(float(mx.abs(p.astype(mx.float32) - c.astype(mx.float32)).max()) for p, c in pairs)
        report["by_batch"][b] = row
        print(b, json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, a.out.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
