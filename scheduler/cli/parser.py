"""The ``mlx-batchd`` parser, assembled from the command modules, and the entry point.

Each command module registers its own sub-parser(s) and holds its command, so this file only fixes
the order the commands are listed in. Building the parser imports no MLX: every command imports
what it needs when it runs.
"""

from __future__ import annotations

from scheduler.cli import bench, convert, demo, generate, keys, probe, serve, stats, synth, top
from scheduler.cli.options import Parser, add_version


def build_parser() -> Parser:
    """The whole command line: local commands first, then the ones that talk to a daemon."""
    parser = Parser(prog="mlx-batchd", description="A batching daemon for MLX models.")
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_parser(sub)
    probe.add_parser(sub)
    bench.add_bursts_parser(sub)
    synth.add_parser(sub)
    convert.add_parser(sub)
    keys.add_parser(sub)
    demo.add_parser(sub)
    bench.add_parser(sub)
    generate.add_parser(sub)
    stats.add_parser(sub)
    top.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (the process arguments by default) and run the command; its exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
