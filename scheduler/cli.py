"""The ``mlx-batchd`` command. Client subcommands import no MLX; ``serve`` loads it lazily."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from clients.address import default_address
from clients.protocol import DEFAULT_MAX_FRAME_BYTES

DEMO_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
]


def _serve(args: argparse.Namespace) -> int:
    from scheduler.admission import Limits
    from scheduler.daemon import DaemonSettings, serve
    from workers.loop import EngineSettings

    settings = DaemonSettings(
        model=args.model,
        listen=args.listen or default_address(),
        context_length=args.context_length,
        limits=Limits(max_tokens_cap=args.max_tokens_cap, default_max_tokens=args.default_max_tokens),
        engine=EngineSettings(
            max_batch=args.max_batch, prefill_batch=args.prefill_batch, prefill_step=args.prefill_step
        ),
        max_frame_bytes=args.max_frame_bytes,
        drain_timeout=args.drain_timeout,
    )
    return serve(settings)


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop or None,
        "timeout": args.timeout,
    }


def _generate(args: argparse.Namespace) -> int:
    from clients import Client, EndEvent, TokenEvent

    kwargs = _sampling_kwargs(args)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    with Client(args.addr) as client:
        for event in client.stream(prompt, **kwargs):
            if isinstance(event, TokenEvent):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, EndEvent):
                sys.stdout.write("\n")
                if event.error is not None:
                    print(f"error: {event.error}", file=sys.stderr)
                    return 1
                t = event.timings
                print(
                    f"[{event.finish_reason}] {event.usage.get('prompt_tokens')} prompt + "
                    f"{event.usage.get('completion_tokens')} generated tokens, "
                    f"ttft {t.get('ttft_s') or 0:.3f}s, decode {t.get('decode_s') or 0:.3f}s",
                    file=sys.stderr,
                )
    return 0


def _stats(args: argparse.Namespace) -> int:
    from clients import Client

    with Client(args.addr, timeout=args.timeout) as client:
        print(json.dumps({"health": client.health(), "stats": client.stats()}, indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Start a daemon on the demo model, send concurrent jobs through the client, stop it."""
    from concurrent.futures import ThreadPoolExecutor

    from clients import Client
    from scheduler.spawn import DaemonProcess

    sock_dir = Path(tempfile.mkdtemp(prefix="mlx-batchd-demo-"))
    daemon = DaemonProcess(args.model, f"ipc://{sock_dir / 'daemon.sock'}")
    print(f"$ {' '.join(daemon.cmd)}", flush=True)
    try:
        health = daemon.wait_ready()
        print(f"daemon ready: {health['model']}")
        with Client(daemon.address) as client:
            tic = time.perf_counter()
            with ThreadPoolExecutor(len(DEMO_PROMPTS)) as pool:
                results = list(pool.map(lambda p: client.generate(p, max_tokens=args.max_tokens), DEMO_PROMPTS))
            wall = time.perf_counter() - tic
        for prompt, r in zip(DEMO_PROMPTS, results):
            print(
                f"\n--- {prompt!r} -> {r.finish_reason}, {r.usage['completion_tokens']} tokens, "
                f"ttft {r.timings['ttft_s']:.3f}s\n{prompt}{r.text}"
            )
        total = sum(r.usage["completion_tokens"] for r in results)
        print(f"\n{len(results)} concurrent requests, {total} tokens in {wall:.2f}s ({total / wall:.1f} tok/s)")
    finally:
        code = daemon.stop()
    print(f"daemon exited with {code}")
    return code


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the whole request")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-batchd", description="A batching daemon for MLX models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--model", default="demo", help="a local mlx-lm model directory, or 'demo' (default)")
    p.add_argument("--listen", default=None, help=f"ZeroMQ address to bind (default {default_address()})")
    p.add_argument("--max-batch", type=int, default=32, help="most sequences decoded together")
    p.add_argument("--prefill-batch", type=int, default=8, help="most prompts prefilled together")
    p.add_argument("--prefill-step", type=int, default=2048, help="prompt tokens per prefill chunk")
    p.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--context-length", type=int, default=None, help="override the model's context length")
    p.add_argument("--max-frame-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=0.0,
        help="on SIGTERM/SIGINT, let in-flight requests finish for up to this many seconds",
    )
    p.set_defaults(func=_serve)

    p = sub.add_parser("generate", help="send one prompt to a running daemon and stream the answer")
    p.add_argument("prompt")
    p.add_argument("--addr", default=None, help="daemon address (default: the local ipc socket)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    _add_sampling(p)
    p.set_defaults(func=_generate)

    p = sub.add_parser("stats", help="print a running daemon's health and counters")
    p.add_argument("--addr", default=None)
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_stats)

    p = sub.add_parser("demo", help="start a daemon on the demo model and run concurrent jobs through it")
    p.add_argument("--model", default="demo")
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=_demo)

    p = sub.add_parser("bench", help="daemon vs raw BatchGenerator decode throughput")
    p.add_argument("--model", default="demo")
    p.add_argument("--batch-sizes", default="1,4,8,16")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="docs/bench", help="folder for JSON, Markdown and PNG results")
    p.set_defaults(func=lambda a: __import__("scheduler.bench", fromlist=["main"]).main(a))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
