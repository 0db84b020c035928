"""What every bench writes: progress lines, and files replaced whole so that a run stopped by an outer
timeout leaves the previous version of a table, never half of one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class BenchError(Exception):
    """A benchmark that cannot run as asked (a prompt longer than the model's context, a missing
    client library): the command line prints it as one line and exits 1."""


def write_whole(path: Path, text: str) -> None:
    """Whole or not at all: a run stopped mid-write keeps the previous version, never half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_png(fig: Any, path: Path) -> None:
    """``write_whole`` for a figure; the figure is closed so that rewriting after every batch size
    does not pile figures up."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.tight_layout()
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def progress(line: str) -> None:
    """One line per step, flushed at once: a long run's log shows where it is even when piped."""
    print(line, flush=True)
