"""Engine decode tok/s with the w4a16 kernel offered to calibration against the same engine without it.

Each arm sets ``MLX_BATCHD_W4A16`` (``1`` / ``0``), calibrates (the plan store keeps one set of plans
per setting, so only a fresh store pays for the timing) and builds an engine, which installs that
arm's plans; the arms alternate at each batch size after an untimed warm-up. Decode only: each run
is timed from its first tokens to its last. The daemon's buffer-cache limit and attention setting
apply, as in the bench's engine arm. MLX CUDA only (the kernel's only backend).

    python3 benchmarks/w4a16_engine.py MODEL --batch-sizes 32,128,256 --out w4a16_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import mlx.core as mx

from workers import envs
from workers.api import EngineSettings, Job, Tokens
from workers.engine.engine import Engine
from workers.engine.startup import buffer_cache_limit
from workers.kernels import fastpath, plan_units
from workers.kernels.backend import configure_attention
from workers.models import cache_dir
from workers.models.loading import load

ARMS = {"mlx": "0", "w4a16": "1"}
#: Each arm's installed plans (``fastpath.plans_summary`` lines), for the record.
PLANS: dict[str, dict[str, str]] = {}


def engine_for(model: Any, vocab: int, batch: int, switch: str) -> Engine:
    """An engine on ``model`` with the plans calibrated under ``MLX_BATCHD_W4A16=switch``."""
    os.environ[envs.W4A16.name] = switch
    plan_units.calibrate(model, cache_dir() / "kernel-plans")
    engine = Engine(model, eos_token_ids=(), vocab_size=vocab, max_batch=max(batch, 32))
    PLANS[switch] = engine.kernel_plans
    return engine


def decode_rate(engine: Engine, vocab: int, batch: int, tokens: int, prompt: int) -> float:
    """Generated tokens a second from the first tokens of ``batch`` sequences to their last."""
    rng = random.Random(batch)
    for i in range(batch):
        ids = [rng.randrange(min(1000, vocab // 2), vocab - 1) for _ in range(prompt)]
        engine.submit(Job(seq=i, prompt=ids, max_tokens=tokens))
    made, tic = 0, 0.0
    while engine.has_work:
        step = sum(len(e.tokens) for e in engine.step() if isinstance(e, Tokens))
        if tic == 0.0 and step:
            tic = time.perf_counter()
        elif tic:
            made += step
    return made / (time.perf_counter() - tic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch-sizes", default="32,128,256")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()

    mx.set_cache_limit(buffer_cache_limit(EngineSettings()))
    configure_attention(EngineSettings().cudnn_attention)
    loaded = load(args.model)
    model = loaded.model
    vocab = loaded.info.vocab_size
    fastpath.set_active(fastpath.CUDA)
    results: dict[str, Any] = {"device": str(mx.default_device()), "model": args.model, "rows": []}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        rates: dict[str, list[float]] = {name: [] for name in ARMS}
        for switch in ARMS.values():
            decode_rate(engine_for(model, vocab, batch, switch), vocab, batch, 8, args.prompt_tokens)
        for _ in range(args.repeats):
            for name, switch in ARMS.items():
                engine = engine_for(model, vocab, batch, switch)
                rates[name].append(decode_rate(engine, vocab, batch, args.tokens, args.prompt_tokens))
        med = {name: statistics.median(v) for name, v in rates.items()}
        row = {"batch": batch, "tok_s": rates, "median": med, "ratio": med["w4a16"] / med["mlx"]}
        results["rows"].append(row)
        spread = ", ".join(f"{n} {med[n]:.1f} tok/s ({min(v):.1f}-{max(v):.1f})" for n, v in rates.items())
        print(f"B={batch}: {spread}, w4a16 / mlx {row['ratio']:.3f}", flush=True)
    results["plans"] = {name: PLANS.get(switch, {}) for name, switch in ARMS.items()}
    for line in results["plans"]["w4a16"].items():
        print("w4a16 plan", *line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
