"""Where a lone request's time goes through a daemon: its first token, the gaps between tokens, and
the wall time outside the engine's own steps.

    python benchmarks/b1_timeline.py --model demo --tokens 128 --repeats 6 --out timeline.json
    python benchmarks/b1_timeline.py --model demo --daemon-args=--engine-thread --out thread.json

One daemon (``mlx-batchd serve``, its defaults unless ``--daemon-args``), one client streaming one
request at a time. For each repeat: milliseconds to the first token event and to the end, the
median and largest gap between token events, and the engine's step counters over the request
(``stats``: steps, their seconds, decode steps and theirs). ``outside_steps_ms`` is the wall time
the engine's steps do not account for (admission, the hops between processes, the loop's own work
between steps): what a daemon adds to the engine alone for one request.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients import Client  # noqa: E402
from scheduler.bench.arms import random_prompts  # noqa: E402
from scheduler.spawn import DaemonProcess  # noqa: E402

COUNTERS = ("steps", "step_seconds", "decode_steps", "decode_seconds", "prefill_steps")


def one(client: Client, prompt: list[int], tokens: int) -> dict[str, Any]:
    before = client.stats()["engine"]
    tic = time.perf_counter()
    arrivals: list[float] = []
    for event in client.stream(tokens=prompt, max_tokens=tokens):
        if getattr(event, "tokens", None):
            arrivals.append(time.perf_counter() - tic)
    end = time.perf_counter() - tic
    after = client.stats()["engine"]
    steps = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {
        "first_token_ms": 1e3 * arrivals[0],
        "end_ms": 1e3 * end,
        "gap_median_ms": 1e3 * statistics.median(gaps),
        "gap_max_ms": 1e3 * max(gaps),
        "engine": steps,
        "outside_steps_ms": 1e3 * (end - steps["step_seconds"]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--daemon-args", default="", help="extra `serve` options, after '='")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    folder = tempfile.mkdtemp(prefix="mlx-batchd-timeline-")
    rows = []
    with (
        DaemonProcess(a.model, f"ipc://{folder}/d.sock", *shlex.split(a.daemon_args)) as proc,
        Client(proc.address, timeout=600) as client,
    ):
        vocab = int(client.wait_ready(timeout=60).get("vocab_size", 256) or 256)
        for rep, prompt in enumerate(random_prompts(a.repeats, a.prompt_tokens, vocab, seed=1)):
            row = one(client, prompt, a.tokens)
            rows.append(row)
            e = row["engine"]
            print(
                f"repeat {rep + 1}/{a.repeats}: first token {row['first_token_ms']:.1f} ms, end {row['end_ms']:.1f} ms, "
                f"gap median {row['gap_median_ms']:.2f} ms (max {row['gap_max_ms']:.1f}); engine {e['steps']} steps "
                f"in {1e3 * e['step_seconds']:.1f} ms ({e['decode_steps']} decode, {1e3 * e['decode_seconds']:.1f} ms); "
                f"outside the steps {row['outside_steps_ms']:.1f} ms",
                flush=True,
            )
    summary = {
        k: statistics.median(r[k] for r in rows)
        for k in ("first_token_ms", "end_ms", "gap_median_ms", "outside_steps_ms")
    }
    print("medians:", json.dumps({k: round(v, 2) for k, v in summary.items()}))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows, "medians": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
