"""Device measurement: whether the engine's classic B = 1 decode computes the bytes a burst's chain does.

    python benchmarks/lone_path_probe.py --model "$M" --tokens 128 --out lone.json

A lone sequence's classic steps run inside mlx-lm's ``BatchGenerator``: the prompt prefilled in a
single-sequence ``KVCache``, then merged into a ``BatchKVCache`` of one row, whose decode passes an
array mask and array offsets to the model. A burst verifies on the sequence's extracted ``KVCache``
and the probe compares its block against a chain of one-token forwards on such a cache. If the two
classic paths give different logits, a verdict says nothing about the engine's own output
(``workers.kernels.lone_mask`` is the engine's answer). This runs one greedy sequence through each path,
teacher-forced on the batched path's tokens, and reports per path the first step whose logits differ
in any byte from the batched path's, and how many do:

- ``batched``: the engine's path (``BatchKVCache.merge`` of the prefilled cache; ``lone_mask`` on);
- ``batched-with-mask``: the same with mlx-lm's all-true one-row decode mask (``lone_mask`` off);
- ``chain``: the prefilled ``KVCache`` stepped on (the probe's chain);
- ``extracted``: ``BatchKVCache.extract`` after the first decode steps, then stepped on (a burst's cache).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from workers.engine.engine import Engine
from workers.models.loading import load


def _steps(forward: Any, cache: list[Any], tokens: list[int]) -> list[mx.array]:
    out = []
    for t in tokens:
        logits = forward(mx.array([[t]]), cache)[:, -1]
        mx.eval(logits)
        out.append(logits)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--extract-after", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    loaded = load(a.model)
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size, max_batch=4)
    model = engine.counted
    prompt = [(7 * i) % 200 + 5 for i in range(32)]

    def prefilled() -> list[Any]:
        cache = make_prompt_cache(loaded.model)
        mx.eval(model(mx.array([prompt[:-1]]), cache))
        return cache

    # The batched path, greedy: its tokens are what every other path is teacher-forced on.
    batch = [BatchKVCache.merge([c]) for c in prefilled()]
    tokens, ref = [prompt[-1]], []
    for _ in range(a.tokens):
        logits = model(mx.array([[tokens[-1]]]), batch)[:, -1]
        mx.eval(logits)
        ref.append(logits)
        tokens.append(int(mx.argmax(logits, axis=-1).item()))
    feed = tokens[:-1]

    def with_mask(inputs: mx.array, cache: list[Any]) -> mx.array:
        patched = BatchKVCache.make_mask
        BatchKVCache.make_mask = getattr(patched, "__wrapped__", patched)  # type: ignore[method-assign]
        try:
            return model(inputs, cache)
        finally:
            BatchKVCache.make_mask = patched  # type: ignore[method-assign]

    paths: dict[str, list[mx.array]] = {
        "batched-again": _steps(model, [BatchKVCache.merge([c]) for c in prefilled()], feed),
        "batched-with-mask": _steps(with_mask, [BatchKVCache.merge([c]) for c in prefilled()], feed),
        "chain": _steps(model, prefilled(), feed),
    }
    merged = [BatchKVCache.merge([c]) for c in prefilled()]
    head = _steps(model, merged, feed[: a.extract_after])
    paths["extracted"] = head + _steps(model, [c.extract(0) for c in merged], feed[a.extract_after :])
    report: dict[str, Any] = {"model": a.model, "tokens": a.tokens, "paths": {}}
    for name, logits in paths.items():
        differ = [
            i
            for i, (x, y) in enumerate(zip(logits, ref, strict=True))
            if not mx.array_equal(x.view(mx.uint8), y.view(mx.uint8)).item()
        ]
        argmax = [i for i, x in enumerate(logits) if int(mx.argmax(x, axis=-1).item()) != tokens[i + 1]]
        row = {
            "first_byte_difference": differ[0] if differ else None,
            "steps_differing": len(differ),
            "first_token_difference": argmax[0] if argmax else None,
            "tokens_differing": len(argmax),
        }
        report["paths"][name] = row
        print(name, json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
