"""Device measurement behind ``workers/kernels/batch_filter.py``: what a step in which a sequence finishes
costs over a plain decode step, with mlx-lm's per-layer ``filter`` and with the project's.

    python benchmarks/filter_probe.py --model "$M" --out filter.json

A ``BatchGenerator`` decodes B sequences whose budgets end one sequence every other step, so that
finishing steps and plain steps alternate; each ``next()`` is timed to the end of its device work.
Arms alternate (stock mlx-lm, then the project's patches) over several repeats; the report gives the
median milliseconds of a plain step and of what a finishing step costs over its plain neighbours.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import mlx.core as mx

from workers.kernels import stock
from workers.models.loading import load


def run(model: Any, vocab: int, batch: int, context: int, seed: int) -> tuple[list[float], list[float]]:
    """One batch to its end: the milliseconds of plain decode steps, and each finishing step's
    milliseconds over the mean of the plain steps on either side (the batch shrinks as it goes)."""
    from mlx_lm.generate import BatchGenerator

    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab - 4) for _ in range(context)] for _ in range(batch)]
    budgets = [8 + 2 * i for i in range(batch)]  # one sequence ends every other step after the 8th
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=batch, prefill_batch_size=batch)
    gen.insert(prompts, max_tokens=budgets)
    steps: list[tuple[bool, float]] = []
    while True:
        tic = time.perf_counter()
        responses = gen.next_generated()
        mx.synchronize()
        if not responses:
            break
        steps.append((any(r.finish_reason for r in responses), (time.perf_counter() - tic) * 1e3))
    gen.close()
    steps = steps[3:]  # past prefill and the first decode steps
    plain = [ms for done, ms in steps if not done]
    extra = [
        ms - (steps[i - 1][1] + steps[i + 1][1]) / 2
        for i, (done, ms) in enumerate(steps)
        if done and 0 < i < len(steps) - 1 and not steps[i - 1][0] and not steps[i + 1][0]
    ]
    return plain, extra


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    loaded = load(a.model)
    model, vocab = loaded.model, loaded.info.vocab_size
    samples: dict[str, dict[str, list[float]]] = {arm: {"plain": [], "extra": []} for arm in ("stock", "project")}
    run(model, vocab, a.batch, a.context, 0)  # warm-up: kernels for these shapes
    for rep in range(a.repeats):
        for arm in ("stock", "project") if rep % 2 == 0 else ("project", "stock"):
            if arm == "stock":
                with stock():
                    plain, extra = run(model, vocab, a.batch, a.context, rep)
            else:
                plain, extra = run(model, vocab, a.batch, a.context, rep)
            samples[arm]["plain"] += plain
            samples[arm]["extra"] += extra
            print(
                f"rep {rep} {arm}: plain step {statistics.median(plain):.2f} ms, "
                f"a finishing step {statistics.median(extra):+.2f} ms over its neighbours",
                flush=True,
            )
    summary = {
        arm: {
            "plain_ms": statistics.median(s["plain"]),
            "finishing_extra_ms": statistics.median(s["extra"]),
            "finishing_extra_range": [min(s["extra"]), max(s["extra"])],
            "steps": [len(s["plain"]), len(s["extra"])],
        }
        for arm, s in samples.items()
    }
    print(json.dumps(summary, indent=1))
    with open(a.out, "w") as f:
        json.dump({"batch": a.batch, "context": a.context, "summary": summary, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
