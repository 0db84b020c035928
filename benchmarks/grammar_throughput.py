"""Decode throughput at B = 16 with every sequence under a control, against the same batch without,
through a real daemon (demo model by default) and the client library. ``--control``:
``json-schema`` (every sequence constrained by a JSON schema), ``penalties`` (presence, frequency and
repetition penalties and a ``logit_bias`` on every sequence), ``mixed`` (every other sequence with
those penalties, the rest plain: a batch step's time is every row's, so this is the plain rows' speed).
Both arms generate exactly ``--tokens`` tokens per sequence: the plain arm ignores end-of-sequence,
and the schema (an array of at least 200 small objects) cannot be complete within the budget, so
every constrained sequence runs to its length too. The arms alternate ``--rounds`` times after a
warm-up of each; printed: each round's generated tokens per second, the engine's mean decode step
(``stats.engine`` decode seconds over decode steps) and the median ratio.

    PYTHONPATH=. .venv/bin/python benchmarks/grammar_throughput.py [--model demo] [--batch 16] [--control json-schema]
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


#: What a sequence under ``--control penalties`` (and half of ``mixed``) carries.
PENALTIES: dict[str, Any] = {
    "ignore_eos": True,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "logit_bias": {"5": -2.0, "7": 1.0},
}
CONTROLS = ("json-schema", "penalties", "mixed")


def fields(control: str | None, i: int) -> dict[str, Any]:
    """The fields of the batch's ``i``-th request under ``control`` (``None``: plain)."""
    if control == "json-schema":
        return {"response_format": {"type": "json_schema", "schema": SCHEMA}}
    if control == "penalties" or (control == "mixed" and i % 2 == 0):
        return PENALTIES
    return {"ignore_eos": True}


def run(client: Client, batch: int, tokens: int, control: str | None, steps: list[float] | None = None) -> float:
    reqs = [
        {"prompt": PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), "max_tokens": tokens, **fields(control, i)}
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
    ap.add_argument("--control", choices=CONTROLS, default="json-schema")
    a = ap.parse_args()
    d = start_daemon(a.model, Path(tempfile.mkdtemp(prefix="grammar-tp-")), "--prefix-cache-mb", "0")
    try:
        with Client(d.address, timeout=600) as c:
            run(c, a.batch, 16, None), run(c, a.batch, 16, a.control)  # warm-up
            plain, controlled, plain_step, controlled_step = [], [], [], []  # type: ignore[var-annotated]
            for i in range(a.rounds):
                plain.append(run(c, a.batch, a.tokens, None, plain_step))
                controlled.append(run(c, a.batch, a.tokens, a.control, controlled_step))
                print(
                    f"round {i}: plain {plain[-1]:.0f} tok/s ({plain_step[-1] * 1e3:.2f} ms/step), "
                    f"{a.control} {controlled[-1]:.0f} tok/s ({controlled_step[-1] * 1e3:.2f} ms/step)"
                )
        ratios = [c / p for p, c in zip(plain, controlled)]
        print(
            f"B={a.batch}, {a.tokens} tokens each: plain {statistics.median(plain):.0f} tok/s, {a.control} "
            f"{statistics.median(controlled):.0f} tok/s, ratio median {statistics.median(ratios):.3f} "
            f"(rounds {', '.join(f'{r:.3f}' for r in ratios)}); decode step plain "
            f"{statistics.median(plain_step) * 1e3:.2f} ms, {a.control} {statistics.median(controlled_step) * 1e3:.2f} ms"
        )
    finally:
        d.stop()


if __name__ == "__main__":
    main()
