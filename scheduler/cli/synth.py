"""``mlx-batchd synth``: write a random-weight model directory from a preset config, for tests and
benchmarks that need an architecture's shapes but not its trained weights."""

from __future__ import annotations

import argparse
from pathlib import Path

from scheduler.cli.errors import CommandError, local_command
from scheduler.cli.options import Parser, int_in


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``synth``."""
    p = sub.add_parser("synth", help="write a random-weight model directory from a preset config")
    p.add_argument("--preset", required=True, help="a name from workers.models.synthetic.PRESETS (e.g. tiny-llama)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    p.set_defaults(func=local_command("synth", run))


def run(args: argparse.Namespace) -> int:
    """Write the model and print its directory; an unknown preset is the one-line ``PresetError``."""
    from workers.models.synthetic import preset, write_model

    config = preset(args.preset)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = write_model(out, config, seed=args.seed)
    except OSError as exc:
        raise CommandError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(path)
    return 0
