"""The installed command refuses an out-of-range option (``--max-batch 0``) in one line, exit 2, with
no daemon started: the parser's range checks through the real entry point, in a subprocess."""

from __future__ import annotations

import subprocess
import sys


def test_the_installed_command_refuses_a_zero_batch_in_one_line() -> None:
    """Through the real entry point: no daemon starts, nothing else is printed."""
    out = subprocess.run(
        [sys.executable, "-m", "scheduler", "serve", "--max-batch", "0"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "mlx-batchd serve: argument --max-batch: must be an integer >= 1, got 0 (see `mlx-batchd serve --help`)\n"
    )
