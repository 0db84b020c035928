"""B = 1 decode through daemons of two (or more) source trees on one machine, the trees' requests
alternating: whether a change of the code moved the daemon's B = 1 speed, with the machine's drift
hitting every tree alike (the bench's arms cannot come from different trees).

Each tree's daemon is started from its own folder (``python -m scheduler serve`` with that folder first
on the path), one after the other, each idle (start-up work and probe done) before the next; then
``--repeats`` rounds, each tree once a round in a rotated order, one request of ``--tokens`` tokens on a
random prompt of ``--prompt-tokens``, streamed. Prints two tables (median and min-max; each tree against
the first as the median of the rounds' paired ratios): the request's tokens over its wall time, and the
decode rate (the tokens after the first event over the time from it to the last: no prefill, no first
token's wait). ``--out FILE`` writes the samples as JSON and a PNG beside it.

    python benchmarks/b1_trees.py MODEL --tree before=/path/to/old/checkout --tree after=. \
        --tokens 128 --repeats 8 --daemon-args="--prefix-cache-mb 0"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from clients.events import TokenEvent
from clients.sync import Client
from scheduler.bench.arms import random_prompts, wait_idle
from scheduler.bench.output import progress, save_png
from scheduler.bench.spreads import paired_ratio, rotated, spread, with_spread


def start(name: str, tree: Path, model: str, address: str, extra: list[str], log: Path) -> subprocess.Popen[str]:
    """``tree``'s daemon: its folder is the child's working directory and first on its path, so
    ``python -m scheduler`` (and the engine process it starts) import that tree's code."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "scheduler", "serve", "--model", model, "--listen", address, *extra]
    progress(f"b1_trees: starting '{name}' from {tree}")
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


def timed_stream(client: Client, prompt: list[int], max_tokens: int) -> tuple[int, float, float]:
    """One greedy request, streamed: its tokens, its wall time, and its decode rate (tokens after the
    first event over the time from that event to the last)."""
    tic = time.perf_counter()
    first: tuple[float, int] | None = None
    last, n = tic, 0
    for event in client.stream(tokens=prompt, max_tokens=max_tokens):
        if isinstance(event, TokenEvent) and event.tokens:
            last = time.perf_counter()
            n += len(event.tokens)
            if first is None:
                first = (last, n)
    wall = time.perf_counter() - tic
    if first is None or last <= first[0]:
        return n, wall, float("nan")
    return n, wall, (n - first[1]) / (last - first[0])


def table(samples: dict[str, list[float]], what: str) -> str:
    """Median (min-max) of each tree's samples, and its paired ratio against the first tree's."""
    base = next(iter(samples))
    lines = [f"| tree | {what}, median (min-max) | against {base}, paired median (min-max) |", "|---|---|---|"]
    for name, xs in samples.items():
        paired = paired_ratio(xs, samples[base])
        ratio = "-" if paired is None else with_spread(paired[0], paired[1], ".3f")
        lines.append(f"| {name} | {with_spread(statistics.median(xs), spread(xs), '.1f')} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tree", action="append", required=True, help="NAME=FOLDER (repeat; the first is the base)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--daemon-args", default="", help="extra serve options for every daemon, one shell string")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    trees = {name: Path(folder).resolve() for name, _, folder in (t.partition("=") for t in args.tree)}
    extra = ["--max-tokens-cap", str(args.tokens), *shlex.split(args.daemon_args)]
    tmp = Path(tempfile.mkdtemp(prefix="b1-trees-"))
    procs: dict[str, subprocess.Popen[str]] = {}
    clients: dict[str, Client] = {}
    samples: dict[str, list[float]] = {n: [] for n in trees}
    decode: dict[str, list[float]] = {n: [] for n in trees}
    try:
        for name, tree in trees.items():
            # One at a time, each idle before the next starts: kernel plans are timed with the GPU to themselves.
            proc = procs[name] = start(name, tree, args.model, f"ipc://{tmp / name}.sock", extra, tmp / f"{name}.log")
            clients[name] = Client(f"ipc://{tmp / name}.sock", timeout=600)
            deadline = time.monotonic() + args.ready_timeout
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"b1_trees: '{name}' exited with {proc.returncode}; its log: {tmp / name}.log")
                try:
                    clients[name].wait_ready(timeout=1.0)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"b1_trees: '{name}' not ready in {args.ready_timeout:g} s") from None
            wait_idle({name: clients[name]})
            progress(f"b1_trees: '{name}' ready and idle")
        progress("b1_trees: one untimed request each")
        for name in trees:
            timed_stream(clients[name], random_prompts(1, args.prompt_tokens, 256, 999)[0], args.tokens)
        for rep in range(args.repeats):
            prompt = random_prompts(1, args.prompt_tokens, 256, rep)[0]
            for name in rotated(list(trees), rep):
                wait_idle(clients)
                n, wall, rate = timed_stream(clients[name], prompt, args.tokens)
                samples[name].append(n / wall)
                decode[name].append(rate)
                progress(
                    f"b1_trees [{rep + 1}/{args.repeats}] {name}: {n} tokens in {wall:.3f} s = {n / wall:.1f} tok/s,"
                    f" decode {rate:.1f} tok/s"
                )
    finally:
        for c in clients.values():
            c.close()
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)
    print(table(samples, "tok/s a request"))
    print(table(decode, "decode tok/s"))
    if args.out is not None:
        meta: dict[str, Any] = {**vars(args), "trees": {n: str(t) for n, t in trees.items()}}
        args.out.write_text(json.dumps({"meta": meta, "tok_s": samples, "decode_tok_s": decode}, indent=1, default=str))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 1 + 0.6 * len(samples)), sharey=True)
        for ax, data, label in ((axes[0], samples, "tok/s a request"), (axes[1], decode, "decode tok/s")):
            for i, xs in enumerate(data.values()):
                ax.scatter(xs, [i] * len(xs), alpha=0.6)
            ax.set_xlabel(f"B = 1 {label} ({args.tokens} tokens a request)")
        axes[0].set_yticks(range(len(samples)), list(samples))
        save_png(fig, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
