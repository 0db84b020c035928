"""``mlx-batchd convert``: a GGUF file (llama.cpp's, Ollama's) into an mlx-lm model folder.

``serve --model FILE.gguf`` does the same once into the cache by itself; this command is for a
folder of one's own (to copy, inspect or serve with other MLX tools). A file that cannot be
converted (truncated, corrupt, an architecture or tensor type not taken, no tokenizer) is one line
and exit 2, and leaves nothing behind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scheduler.cli.errors import CommandError, local_command
from scheduler.cli.options import Parser

_DTYPES = ("auto", "float32", "float16", "bfloat16")


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``convert``."""
    p = sub.add_parser("convert", help="convert a GGUF file (or ollama:NAME[:TAG]) into an mlx-lm model folder")
    p.add_argument("source", metavar="FILE.gguf", help="a GGUF file, or ollama:NAME[:TAG] from Ollama's local store")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    p.add_argument(
        "--scales-dtype",
        choices=_DTYPES,
        default="auto",
        help="dtype of the quantization scales and norms: auto is float32 on the CPU backend (its quantized "
        "matmul is much faster so), float16 on a GPU",
    )
    p.set_defaults(func=local_command("convert", run))


def run(args: argparse.Namespace) -> int:
    """Convert, print each notice and the folder; ``GGUFError`` is the wrapper's one line, exit 2."""
    import mlx.core as mx

    from workers.models.gguf import OLLAMA_PREFIX, convert, resolve_ollama

    out = Path(args.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CommandError(f"--out {out} already exists and is not an empty folder; name a new one")
    if args.source.startswith(OLLAMA_PREFIX):
        path, _ = resolve_ollama(args.source)
    else:
        path = Path(args.source).expanduser()
        if not path.is_file():
            raise CommandError(f"{args.source}: no such file")
    dtype = None if args.scales_dtype == "auto" else getattr(mx, args.scales_dtype)
    try:
        if out.is_dir():
            out.rmdir()  # empty: the converted folder is renamed into its place whole
        report = convert(path, out, dtype=dtype, progress=sys.stderr.isatty(), source={"label": path.stem})
    except OSError as exc:
        raise CommandError(f"cannot write {out}: {exc.strerror or exc}") from None
    for notice in report.notices:
        print(f"mlx-batchd convert: {notice}", file=sys.stderr)
    widths = "unquantized"
    if report.quantization:
        others = sorted({v["bits"] for v in report.quantization.values() if isinstance(v, dict)})
        widths = f"{report.quantization['bits']}-bit" + "".join(f", {b}-bit in places" for b in others)
    print(f"{report.out} ({report.architecture}, {widths}, group 32, scales {report.scales_dtype})")
    return 0
