"""``mlx-batchd bench``: decode throughput through the daemon vs raw ``BatchGenerator``.

Both arms run the same workload in the same run: B greedy sequences with random prompts of the
same length, every request submitted at once, timed from the first submit to the last token.
The raw arm drives ``BatchGenerator`` in this process; the daemon arm drives a daemon child
process through the client library, as a user would. Arms alternate per repeat so that drift
in the machine's speed hits both; the median of the repeats is reported.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def _prompts(b: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, min(vocab, 256)) for _ in range(n)] for _ in range(b)]


def run_raw(model: Any, eos: list[int], prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Generated tokens and seconds for one workload on a fresh ``BatchGenerator``."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[[t] for t in eos], completion_batch_size=32, prefill_batch_size=8)
    tic = time.perf_counter()
    gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    produced = 0
    while responses := gen.next_generated():
        produced += sum(1 for r in responses if r.finish_reason != "stop")
    wall = time.perf_counter() - tic
    gen.close()
    return produced, wall


def run_daemon(client: Any, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    tic = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: client.generate(tokens=p, max_tokens=max_tokens), prompts))
    wall = time.perf_counter() - tic
    return sum(r.usage["completion_tokens"] for r in results), wall


def write_report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    """JSON, a Markdown table and a PNG plot; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "daemon_vs_raw.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        "| B | raw BatchGenerator tok/s | daemon tok/s | daemon / raw |",
        "|---|---|---|---|",
        *(f"| {r['batch']} | {r['raw_tok_s']:.1f} | {r['daemon_tok_s']:.1f} | {r['ratio']:.3f} |" for r in rows),
    ]
    md = "\n".join(lines) + "\n"
    (out / "daemon_vs_raw.md").write_text(md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    bs = [r["batch"] for r in rows]
    ax.plot(bs, [r["raw_tok_s"] for r in rows], "o-", label="raw BatchGenerator")
    ax.plot(bs, [r["daemon_tok_s"] for r in rows], "s-", label="daemon (client over ipc)")
    ax.set_xlabel("concurrent sequences (B)")
    ax.set_ylabel("generated tokens / s")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{meta['model']} on {meta['device']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "daemon_vs_raw.png", dpi=120)
    return md


def main(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm.utils import load as mlx_load
    from tqdm import tqdm

    from clients.sync import Client
    from scheduler.spawn import DaemonProcess
    from workers.models import resolve_model_path

    # The raw arm is plain mlx-lm, loaded without the daemon's kernel-level patches, so the
    # ratio includes everything the daemon adds.
    path = resolve_model_path(args.model)
    model, tokenizer = mlx_load(str(path))[:2]
    eos = sorted(tokenizer.eos_token_ids)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    sock = Path(tempfile.mkdtemp(prefix="mlx-batchd-bench-")) / "daemon.sock"
    samples: dict[tuple[str, int], list[float]] = {}
    with DaemonProcess(args.model, f"ipc://{sock}", "--max-tokens-cap", str(args.tokens)) as daemon:
        with Client(daemon.address, timeout=3600) as client:
            warm = _prompts(2, args.prompt_tokens, vocab, seed=99)
            run_raw(model, eos, warm, 8)
            run_daemon(client, warm, 8)
            steps = [(b, rep, arm) for b in batches for rep in range(args.repeats) for arm in ("raw", "daemon")]
            for b, rep, arm in tqdm(steps, desc="bench", unit="run"):
                prompts = _prompts(b, args.prompt_tokens, vocab, seed=1000 * b + rep)
                if arm == "raw":
                    n, wall = run_raw(model, eos, prompts, args.tokens)
                else:
                    n, wall = run_daemon(client, prompts, args.tokens)
                samples.setdefault((arm, b), []).append(n / wall)
    rows = []
    for b in batches:
        raw = statistics.median(samples[("raw", b)])
        dmn = statistics.median(samples[("daemon", b)])
        rows.append({"batch": b, "raw_tok_s": raw, "daemon_tok_s": dmn, "ratio": dmn / raw})
    meta = {
        "model": args.model,
        "model_path": str(path),
        "device": str(mx.default_device()),
        "mlx": str(getattr(mx, "__version__", "unknown")),
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
    }
    print(write_report(rows, meta, Path(args.out)))
    return 0
