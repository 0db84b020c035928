"""``mlx-batchd demo``: the main job on the embedded default, end to end.

It starts a daemon on the demo model (with its MTP head as the drafter) as a child process, sends
one request alone (B = 1: speculative bursts) and then several at once (batched), and prints what
each did. It talks to the daemon only through the client library, as any user's program would.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from scheduler.cli.errors import local_command
from scheduler.cli.options import Parser, positive_int

# File-like openings: the byte-level demo model learnt from windows that start mid-file, so a bare
# one-line prompt leaves it guessing the indentation; a line or two of context settles it.
DEMO_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "import os\n\n\ndef read_config(path):\n",
    "def count_words(text):\n    counts = {}\n",
]


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``demo``."""
    p = sub.add_parser("demo", help="start a daemon on the demo model and run concurrent jobs through it")
    p.add_argument("--model", default="demo")
    p.add_argument(
        "--max-tokens", type=positive_int, default=160, help="per request (the demo model's tokens are bytes)"
    )
    p.add_argument(
        "--drafter", default="mtp", help="mtp (the demo MTP head), demo (draft model), prompt-lookup or none"
    )
    p.set_defaults(func=local_command("demo", run))


def run(args: argparse.Namespace) -> int:
    """The main job on the embedded default: a daemon on the demo model with its MTP head as the
    drafter; one request alone (B = 1: speculative bursts), then concurrent requests (batched)."""
    from concurrent.futures import ThreadPoolExecutor

    from clients import Client, TokenEvent
    from scheduler.spawn import DaemonProcess

    extra = (
        [] if args.drafter == "none" else (["--mtp", "demo"] if args.drafter == "mtp" else ["--draft", args.drafter])
    )
    sock_dir = Path(tempfile.mkdtemp(prefix="mlx-batchd-demo-"))
    daemon = DaemonProcess(args.model, f"ipc://{sock_dir / 'daemon.sock'}", *extra)
    print(f"$ {' '.join(daemon.cmd)}", flush=True)
    try:
        health = daemon.wait_ready()
        print(f"daemon ready: {health['model']}")
        with Client(daemon.address) as client:
            _wait_for_verdict(client)
            print(
                f"\n--- one request alone (B = 1, speculative bursts when the probe allows):\n{DEMO_PROMPTS[0]}", end=""
            )
            tic = time.perf_counter()
            n = 0
            for event in client.stream(DEMO_PROMPTS[0], max_tokens=args.max_tokens):
                if isinstance(event, TokenEvent):
                    print(event.text, end="", flush=True)
                    n += len(event.tokens)
            alone = time.perf_counter() - tic
            print(f"\n[{n} tokens in {alone:.2f}s, {n / alone:.1f} tok/s]")
            tic = time.perf_counter()
            with ThreadPoolExecutor(len(DEMO_PROMPTS)) as pool:
                results = list(pool.map(lambda p: client.generate(p, max_tokens=args.max_tokens), DEMO_PROMPTS))
            wall = time.perf_counter() - tic
            for prompt, r in zip(DEMO_PROMPTS, results):
                print(
                    f"\n--- {prompt.splitlines()[0]!r}... -> {r.finish_reason}, {r.usage['completion_tokens']} tokens, "
                    f"ttft {r.timings['ttft_s']:.3f}s\n{prompt}{r.text}"
                )
            total = sum(r.usage["completion_tokens"] for r in results)
            print(f"\n{len(results)} concurrent requests, {total} tokens in {wall:.2f}s ({total / wall:.1f} tok/s)")
            engine = client.stats()["engine"]
            b = engine["bursts"]
            if b["drafter"]:
                rate = b["accepted_tokens"] / b["drafted_tokens"] if b["drafted_tokens"] else 0.0
                print(
                    f"bursts: drafter {b['drafter']}, {b['rounds']} rounds, acceptance {rate:.2f}, "
                    f"verdict {json.dumps(engine['verdicts'])}, pin collateral {engine['pins']['collateral_forwards']}"
                )
    finally:
        code = daemon.stop()
    print(f"daemon exited with {code}")
    return code


def _wait_for_verdict(client: Any, timeout: float = 120.0) -> None:
    """Let the start-up probe finish (bursts wait for its verdict) so the demo shows them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        verdicts = client.stats()["engine"]["verdicts"]
        if not verdicts or all("level" in v for v in verdicts.values()):
            return
        time.sleep(0.1)
