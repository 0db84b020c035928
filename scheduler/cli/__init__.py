"""The ``mlx-batchd`` command. Client subcommands import no MLX; ``serve`` loads it lazily.

A user mistake never ends in a traceback or a silent wait. Options are range-checked by the parser
(one line, exit 2, ``options``); what only shows when a command runs (a path that is not a model, an
address without ``ipc://``, a key file that is not there, no daemon at the address) is one line
naming the problem and the fix, exit 1 (``errors``).

One module per command (``serve``, ``probe``, ``synth``, ``convert``, ``keys``, ``demo``, ``bench``, ``generate``,
``stats``, ``top``), each registering its own sub-parser; ``parser`` puts them together.
"""

from scheduler.cli.bench import BENCH_OUT
from scheduler.cli.errors import CommandError
from scheduler.cli.parser import build_parser, main

__all__ = ["BENCH_OUT", "CommandError", "build_parser", "main"]
