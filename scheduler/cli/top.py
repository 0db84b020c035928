"""``mlx-batchd top``: a live view of a running daemon's ``stats`` reply.

``mlx-batchd stats`` prints one summary; this polls the same reply every ``--interval`` seconds and
redraws it (the frame is drawn by ``scheduler.cli.top_view``). Like the other client subcommands it
imports no MLX, so it starts fast and runs anywhere the client library does; the drawing library is
imported only when the command runs, so ``mlx-batchd --help`` does not pay for it.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from scheduler.cli.errors import daemon_command
from scheduler.cli.options import Parser, add_client_auth, non_negative_int, positive_float
from scheduler.cli.session import client_kwargs

if TYPE_CHECKING:
    from rich.console import Console


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``top``, with the same address, timeout and CURVE options as ``stats`` so the two
    commands are interchangeable on the command line."""
    p = sub.add_parser("top", help="a live view of a running daemon's counters (polls `stats`)")
    p.add_argument("--addr", default=None, help="daemon address (default: the local ipc socket)")
    p.add_argument("--timeout", type=positive_float, default=10.0, help="seconds to wait for each stats reply")
    p.add_argument("--interval", type=positive_float, default=1.0, help="seconds between polls (default 1.0)")
    p.add_argument("--once", action="store_true", help="print one frame to stdout and exit (for scripts)")
    p.add_argument("--iterations", type=non_negative_int, default=0, help="stop after N frames (0 = until Ctrl-C)")
    add_client_auth(p)
    p.set_defaults(func=daemon_command("top", run))


def run(args: argparse.Namespace) -> int:
    """Poll and draw until ``--iterations`` frames are shown or Ctrl-C (exit 0). A daemon that does
    not answer within ``--timeout`` is an error (exit 1) with a message, not a traceback: ``top``
    is often the first thing run to see whether the daemon is up at all."""
    from rich.console import Console

    from clients import Client
    from scheduler.cli.top_view import render

    console = Console()
    try:
        with Client(args.addr, timeout=args.timeout, **client_kwargs(args)) as client:
            if args.once:
                console.print(render(client.stats(), None, 0.0))
                return 0
            return _live(client, console, args.interval, max(0, args.iterations))
    except KeyboardInterrupt:
        return 0  # the usual way to leave a live view


def _live(client: Any, console: Console, interval: float, iterations: int) -> int:
    """Redraw in place every ``interval`` seconds. When stdout is not a terminal (piped to a file or
    a log) each frame is printed in turn instead, since a non-terminal ``Live`` would only show the
    last one."""
    from rich.live import Live

    from scheduler.cli.top_view import between, render

    previous: dict[str, Any] | None = None
    previous_at = 0.0
    frames = 0
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    try:
        if live is not None:
            live.start()
        while True:
            stats = client.stats()
            now = time.monotonic()
            dt = between(stats, previous, now - previous_at)
            frame = render(stats, previous if dt > 0 else None, dt)
            if live is not None:
                live.update(frame, refresh=True)
            else:
                console.print(frame)
            previous, previous_at = stats, now
            frames += 1
            if iterations and frames >= iterations:
                return 0
            time.sleep(interval)
    finally:
        if live is not None:
            live.stop()
