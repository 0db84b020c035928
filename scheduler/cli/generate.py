"""``mlx-batchd generate``: send one prompt to a running daemon and stream the answer.

The sampling options carry the ranges the daemon's protocol accepts (``clients.protocol``), so a
value the daemon would refuse is refused by the parser first, as one line naming the option.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Iterator
from typing import Any

from scheduler.cli.errors import CommandError, daemon_command, unreachable
from scheduler.cli.options import (
    Parser,
    add_client_auth,
    float_in,
    fraction,
    int_in,
    non_negative_int,
    positive_float,
    positive_int,
)
from scheduler.cli.session import CancelOnInterrupt, open_client


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``generate``."""
    p = sub.add_parser("generate", help="send one prompt to a running daemon and stream the answer")
    p.add_argument("prompt")
    p.add_argument("--addr", default=None, help="daemon address (default: the local ipc socket)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    p.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=10.0,
        help="seconds the daemon has to answer a health check first",
    )
    _add_sampling(p)
    add_client_auth(p)
    p.set_defaults(func=daemon_command("generate", run))


def _add_sampling(p: argparse.ArgumentParser) -> None:
    """The request options, with the ranges the daemon's protocol accepts (``clients.protocol``)."""
    p.add_argument("--max-tokens", type=positive_int, default=None)
    p.add_argument("--temperature", type=float_in(0.0, 100.0), default=0.0)
    p.add_argument("--top-p", type=float_in(0.0, 1.0, above=True), default=1.0)
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--min-p", type=fraction, default=0.0)
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--timeout", type=positive_float, default=None, help="seconds for the whole request")
    p.add_argument(
        "--priority",
        type=int_in(-1000, 1000),
        default=None,
        help="higher goes first within your tenant's share (capped by the tenant's max_priority)",
    )


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


def run(args: argparse.Namespace) -> int:
    """Stream one request to the terminal. One Ctrl-C cancels it and exits 130 (``CancelOnInterrupt``)."""
    kwargs = _sampling_kwargs(args)
    if args.priority is not None:
        kwargs["priority"] = args.priority
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    request_id = uuid.uuid4().hex
    with open_client(args, request_id) as client, CancelOnInterrupt(client, request_id) as interrupt:
        try:
            try:  # a daemon that does not answer fails here, not after an endless wait for the first token
                client.health(timeout=args.connect_timeout)
            except TimeoutError:
                keys = args.curve_secret is not None
                raise CommandError(unreachable(client.address, args.connect_timeout, keys)) from None
            if interrupt.interrupted:
                return 130
            try:
                code = _print_stream(client.stream(prompt, request_id=request_id, **kwargs))
            except TimeoutError:
                raise CommandError(
                    f"the request did not end within --timeout {args.timeout:g}s; it was cancelled"
                ) from None
        except CommandError:
            if interrupt.interrupted:
                return 130  # however the cancelled request ended, the user asked to stop
            raise
    return 130 if interrupt.interrupted else code


def _print_stream(events: Iterator[Any]) -> int:
    """Tokens to stdout as they come; the end (or the daemon's error) as one line on stderr."""
    from clients import EndEvent, TokenEvent

    for event in events:
        if isinstance(event, TokenEvent):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, EndEvent):
            sys.stdout.write("\n")
            if event.error is not None:
                raise CommandError(str(event.error))
            t = event.timings
            print(
                f"[{event.finish_reason}] {event.usage.get('prompt_tokens')} prompt + "
                f"{event.usage.get('completion_tokens')} generated tokens, "
                f"ttft {t.get('ttft_s') or 0:.3f}s, decode {t.get('decode_s') or 0:.3f}s",
                file=sys.stderr,
            )
    return 0
