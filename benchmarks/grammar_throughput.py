"""Decode throughput at B = 16 with every sequence constrained by a JSON schema, against the same
batch unconstrained, through a real daemon (demo model by default) and the client library.

Both arms generate exactly ``--tokens`` tokens per sequence: the plain arm ignores end-of-sequence,
and the schema (an array of at least 200 small objects) cannot be complete within the budget, so
every constrained sequence runs to its length too. The arms alternate ``--rounds`` times after a
warm-up of each; printed: each round's generated tokens per second, the engine's mean decode step
(``stats.engine`` decode seconds over decode steps) and the median ratio.

    PYTHONPATH=. .venv/bin/python benchmarks/grammar_throughput.py [--model demo] [--batch 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from clients import Client
from tests.conftest import start_daemon

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
                "required": ["name", "n"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
PROMPTS = ["The capital of France is", "Once upon a time", "def main():", "Alice and Bob"]


def step_seconds(client: Client) -> tuple[float, int]:
    e = client.stats()["engine"]
    return e["decode_seconds"], e["decode_steps"]


def run(client: Client, batch: int, tokens: int, constrained: bool, steps: list[float] | None = None) -> float:
    extra: dict[str, Any] = (
        {"response_format": {"type": "json_schema", "schema": SCHEMA}} if constrained else {"ignore_eos": True}
    )
    reqs = [
        {"prompt": PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), "max_tokens": tokens, **extra}
        for i in range(batch)
    ]
    s0, n0 = step_seconds(client)
    t0 = time.perf_counter()
    results = client.generate_many(reqs)
    wall = time.perf_counter() - t0
    s1, n1 = step_seconds(client)
    if steps is not None:
        steps.append((s1 - s0) / max(1, n1 - n0))
    assert all(len(r.tokens) == tokens for r in results), [len(r.tokens) for r in results]
    return batch * tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    d = start_daemon(a.model, Path(tempfile.mkdtemp(prefix="grammar-tp-")), "--prefix-cache-mb", "0")
    try:
        with Client(d.address, timeout=600) as c:
            run(c, a.batch, 16, False), run(c, a.batch, 16, True)  # warm-up
            plain, constrained, plain_step, constrained_step = [], [], [], []  # type: ignore[var-annotated]
            for i in range(a.rounds):
                plain.append(run(c, a.batch, a.tokens, False, plain_step))
                constrained.append(run(c, a.batch, a.tokens, True, constrained_step))
                print(
                    f"round {i}: plain {plain[-1]:.0f} tok/s ({plain_step[-1] * 1e3:.2f} ms/step), "
                    f"constrained {constrained[-1]:.0f} tok/s ({constrained_step[-1] * 1e3:.2f} ms/step)"
                )
        ratios = [c / p for p, c in zip(plain, constrained)]
        print(
            f"B={a.batch}, {a.tokens} tokens each: plain {statistics.median(plain):.0f} tok/s, constrained "
            f"{statistics.median(constrained):.0f} tok/s, ratio median {statistics.median(ratios):.3f} "
            f"(rounds {', '.join(f'{r:.3f}' for r in ratios)}); decode step plain "
            f"{statistics.median(plain_step) * 1e3:.2f} ms, constrained {statistics.median(constrained_step) * 1e3:.2f} ms"
        )
    finally:
        d.stop()


if __name__ == "__main__":
    main()
