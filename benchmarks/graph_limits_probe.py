"""Device measurement: the engine's decode step under MLX CUDA's graph limits.

    python benchmarks/graph_limits_probe.py --model "$M" --out graph.json

MLX CUDA records the kernels of an evaluation as CUDA graphs and commits one each time it holds
``MLX_MAX_OPS_PER_BUFFER`` nodes or ``MLX_MAX_MB_PER_BUFFER`` megabytes (MLX's defaults on an H100 /
H200: 100 and 1,000); instantiated graphs are kept for reuse (``MLX_CUDA_GRAPH_CACHE_SIZE``, 400).
On the H200 8B synth a decode step at B <= 8 costs far more than its weight bytes say (7-10 ms at
B = 1, where the 4.2 GB of weights read in ~1 ms), so how many graphs a step makes, and how often one
must be instantiated anew, may be a large part of it.

Each setting runs in a fresh process (MLX reads these once per process): the engine alone, greedy,
``--tokens`` a sequence at each ``--batches`` B, ``--repeats`` times after one untimed run; reported
as milliseconds per decode step from the engine's counters (median, min-max) and tokens per second.
``--settings`` is a comma-separated list of ``OPS/MB/CACHE`` (an empty field keeps MLX's default),
``default`` for none set, ``nographs`` for ``MLX_USE_CUDA_GRAPHS=0``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

VARS = ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_CUDA_GRAPH_CACHE_SIZE")


def environment(setting: str) -> dict[str, str]:
    """The variables a setting sets (``default``: none; ``nographs``: graphs off)."""
    if setting == "default":
        return {}
    if setting == "nographs":
        return {"MLX_USE_CUDA_GRAPHS": "0"}
    fields = setting.split("/")
    if len(fields) != 3 or not all(f == "" or f.isdigit() for f in fields):
        raise SystemExit(f"setting {setting!r}: expected OPS/MB/CACHE (digits or empty), default or nographs")
    return {name: value for name, value in zip(VARS, fields, strict=True) if value}


def child(model: str, batches: list[int], tokens: int, repeats: int) -> dict[str, Any]:
    """This process's measurements (run with the setting's environment)."""
    import random

    from workers.api import Job
    from workers.engine.engine import Engine
    from workers.models.loading import load

    loaded = load(model)
    engine = Engine(
        loaded.model,
        eos_token_ids=(),
        vocab_size=loaded.info.vocab_size,
        max_batch=max(batches),
        prefill_batch=8,
    )
    vocab = loaded.info.vocab_size
    out: dict[str, Any] = {}
    for b in batches:
        rng = random.Random(b)
        ms: list[float] = []
        tok_s: list[float] = []
        for rep in range(repeats + 1):  # run 0 warms this batch size up
            ps = [[rng.randrange(10, vocab - 10) for _ in range(32)] for _ in range(b)]
            c = engine.counters
            steps, seconds, wall = c.decode_steps, c.decode_seconds, c.step_seconds
            for i, p in enumerate(ps):
                engine.submit(Job(seq=1000 * rep + i, prompt=p, max_tokens=tokens))
            while engine.has_work:
                engine.step()
            c = engine.counters
            if rep:
                ms.append(1e3 * (c.decode_seconds - seconds) / max(1, c.decode_steps - steps))
                tok_s.append(b * tokens / (c.step_seconds - wall))
        out[str(b)] = {"ms": ms, "tok_s": tok_s}
        print(f"  B = {b}: {statistics.median(ms):.2f} ms a decode step", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--settings", default="default,50//,200//,254//,/4000/,//2000,nographs")
    ap.add_argument("--batches", default="1,4,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("graph-limits.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.child:
        print(json.dumps(child(a.model, batches, a.tokens, a.repeats)))
        return
    results: dict[str, Any] = {}
    for setting in a.settings.split(","):
        env = {k: v for k, v in os.environ.items() if k not in VARS and k != "MLX_USE_CUDA_GRAPHS"}
        env.update(environment(setting))
        print(f"graph limits: {setting} {environment(setting)}", file=sys.stderr, flush=True)
        argv = [sys.executable, __file__, "--child", "--model", a.model, "--batches", a.batches]
        argv += ["--tokens", str(a.tokens), "--repeats", str(a.repeats)]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        sys.stderr.write(done.stderr[-2000:] if done.returncode else "")
        if done.returncode:
            results[setting] = {"error": done.stderr.strip().splitlines()[-1:] or ["exit code"]}
        else:
            results[setting] = json.loads(done.stdout.strip().splitlines()[-1])
        a.out.write_text(json.dumps({"batches": batches, "tokens": a.tokens, "results": results}, indent=1))
    head = "| setting | " + " | ".join(f"B = {b} ms a step (min-max)" for b in batches) + " |"
    print(head + "\n|---|" + "---|" * len(batches))
    for setting, r in results.items():
        if "error" in r:
            print(f"| {setting} | error: {r['error']} |")
            continue
        cells = [r[str(b)]["ms"] for b in batches]
        print(
            f"| {setting} | "
            + " | ".join(f"{statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f})" for c in cells)
            + " |"
        )


if __name__ == "__main__":
    main()
