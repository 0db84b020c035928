"""Device measurement: where a batched decode step's time goes (issue 15).

    python benchmarks/step_anatomy.py --model "$M" --out anatomy.json

On the H200 8B synth an engine decode step costs ~9 ms at B = 1 and ~20-23 ms at B = 4 and 16,
although MLX's quantized matmul at 16 rows costs about what its one-row kernel does. For each B this
times, one synchronous step at a time (so graph building and the device's run add up, and the
building is reported on its own):

- ``engine``: ``Engine.step`` on B decoding sequences (what the bench's engine arm runs; its steps
  overlap building the next step with the device's run, as mlx-lm's generator does);
- ``forward``: the model's forward on B rows with mlx-lm's plain ``KVCache`` (no masks), under each
  kernel policy: ``off`` (stock mlx-lm), ``generic`` (flattened rows, unpadded), ``cuda`` (the
  calibrated plans);
- ``batch-cache``: the same forward on ``BatchKVCache`` (left padding, a mask per step, as
  ``BatchGenerator`` runs it), ``cuda`` policy;
- ``no-attention``: ``batch-cache`` with the fused attention replaced by its query (what everything
  but attention costs);
- ``projections``: only the model's quantized projections, each called as the plan calls it, all
  in one evaluation (the weight-reading floor of a step), side by side and chained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from workers.api import Job
from workers.engine.engine import Engine
from workers.kernels import fastpath, install, plan_units
from workers.models.loading import load

CONTEXT = 64
STEPS = 12


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def forward_ms(model: nn.Module, b: int, batch_cache: bool) -> dict[str, float]:
    """Median ms per synchronous decode step and of building its graph, at ``CONTEXT`` tokens."""
    if batch_cache:
        cache: list[Any] = [BatchKVCache([0] * b) for _ in model.layers]
    else:
        cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 1000, (b, CONTEXT)), cache=cache))
    y = mx.random.randint(0, 1000, (b, 1))
    totals, builds = [], []
    for i in range(STEPS + 3):
        mx.synchronize()
        tic = time.perf_counter()
        out = model(y, cache=cache)[:, -1]
        built = time.perf_counter()
        mx.eval(out)
        if i >= 3:
            totals.append(time.perf_counter() - tic)
            builds.append(built - tic)
    return {"step_ms": _median_ms(totals), "build_ms": _median_ms(builds)}


def engine_ms(model: nn.Module, vocab: int, b: int) -> dict[str, float]:
    """Median ms per ``Engine.step`` once all B sequences decode."""
    engine = Engine(model, eos_token_ids=(), vocab_size=vocab, max_batch=max(b, 1))
    for i in range(b):
        engine.submit(Job(seq=i, prompt=[(7 * i + j) % 1000 + 3 for j in range(32)], max_tokens=400))
    for _ in range(6):  # prefill and the first decode steps
        engine.step()
    samples = []
    for _ in range(STEPS * 2):
        tic = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - tic)
    engine.cancel_all("cancelled")
    return {"step_ms": _median_ms(samples)}


@contextmanager
def no_attention() -> Iterator[None]:
    real = mx.fast.scaled_dot_product_attention

    def query_only(q: mx.array, k: mx.array, v: mx.array, **_: Any) -> mx.array:
        return q

    mx.fast.scaled_dot_product_attention = query_only  # type: ignore[assignment]
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = real  # type: ignore[assignment]


def projections_ms(model: nn.Module, b: int, chained: bool) -> float:
    """Every quantized projection of the model once on B rows, as the plans call it, in one eval;
    ``chained``: each call's input waits for the previous call's output, as in a forward (MLX CUDA
    runs kernels that share no data side by side, so unchained it times how many finish together)."""
    mods = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    xs = {id(m): mx.zeros((b, 1, m.weight.shape[-1] * 32 // m.bits), dtype=m.scales.dtype) for m in mods}
    mx.eval(list(xs.values()))

    def run() -> list[mx.array]:
        outs, dep = [], mx.array(0, dtype=mx.bfloat16)
        for m in mods:
            x = xs[id(m)] if not chained else xs[id(m)] + dep.astype(xs[id(m)].dtype)
            outs.append(m(x))
            dep = outs[-1].reshape(-1)[:1] * 0
        return outs

    samples = []
    for i in range(STEPS + 3):
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(run())
        if i >= 3:
            samples.append(time.perf_counter() - tic)
    return _median_ms(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    a = ap.parse_args()
    install()
    loaded = load(a.model)
    model = loaded.model
    fastpath.set_active(fastpath.CUDA if fastpath.detect() is fastpath.CUDA else fastpath.GENERIC)
    check: dict[int, dict[str, Any]] = {}
    plans = fastpath.plans_summary(plan_units.calibrate(model, report=check))
    report: dict[str, Any] = {"plans": plans, "forward_check": check, "by_batch": {}}
    policies: dict[str, Callable[[], None]] = {
        "off": lambda: fastpath.set_active(fastpath.OFF),
        "generic": lambda: fastpath.set_active(fastpath.GENERIC),
        "cuda": lambda: fastpath.set_active(fastpath.CUDA),
    }
    for b in (int(x) for x in a.batches.split(",")):
        row: dict[str, Any] = {}
        policies["cuda"]()
        row["engine"] = engine_ms(model, loaded.info.vocab_size, b)
        for name, use in policies.items():
            use()
            row[f"forward-{name}"] = forward_ms(model, b, batch_cache=False)
        policies["cuda"]()
        row["batch-cache"] = forward_ms(model, b, batch_cache=True)
        with no_attention():
            row["no-attention"] = forward_ms(model, b, batch_cache=True)
        row["projections_ms"] = projections_ms(model, b, chained=False)
        row["projections_chained_ms"] = projections_ms(model, b, chained=True)
        report["by_batch"][b] = row
        print(b, json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
