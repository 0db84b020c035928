"""Whether the grammar mask waits for the device: mlx-lm's ``BatchGenerator`` at B sequences, plain
and then every sequence under a JSON schema (``workers.engine.grammar_mask.GrammarState`` as the engine wires
it), with each row's processor call timed.

Row 0's call waits for the previous step (the wait ``BatchGenerator`` makes anyway, at the end of a
step); if the mask were on the critical path after the forward, rows 1.. would wait for this step's
forward too. Printed: steps per second of each arm and the median processor time of each row.

    PYTHONPATH=. .venv/bin/python benchmarks/grammar_overlap_probe.py workers/models/demo/weights/target 200
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from benchmarks.grammar_throughput import SCHEMA
from workers.api.grammar import grammar_text, lltokenizer
from workers.engine.grammar_mask import GrammarState

WARM = 5


def timed(state: GrammarState, times: list[float]) -> Callable[[mx.array, mx.array], mx.array]:
    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        t0 = time.perf_counter()
        out = state.processor(tokens, logits)
        times.append(time.perf_counter() - t0)
        return out

    return processor


def main(path: str, steps: int, batch: int = 16) -> None:
    model, tok = load(path)
    lltok = lltokenizer(tok, model.args.vocab_size)
    grammar = grammar_text("json_schema", json.dumps(SCHEMA))
    for constrained in (False, True):
        states = [GrammarState(lltok, grammar, set(tok.eos_token_ids), None) for _ in range(batch)]
        times: list[list[float]] = [[] for _ in range(batch)]
        kw: dict[str, Any] = {}
        if constrained:
            kw = {
                "samplers": [s.sampler for s in states],
                "logits_processors": [[timed(s, times[i])] for i, s in enumerate(states)],
            }
        gen = BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=batch)
        gen.insert([tok.encode("Hello there " * (i + 1)) for i in range(batch)], max_tokens=[steps] * batch, **kw)
        n, t0 = 0, 0.0
        while gen.next_generated():
            n += 1
            if n == WARM:
                t0 = time.perf_counter()
        rate = (n - WARM) / (time.perf_counter() - t0)
        print(f"{'constrained' if constrained else 'plain'}: {rate:.2f} steps/s at B = {batch}")
        if constrained:
            rows = [statistics.median(t[WARM:]) * 1e6 for t in times]
            print("median processor us per row:", " ".join(f"{x:.0f}" for x in rows))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200)
