"""Where the daemon listens by default: an ``ipc://`` socket private to the user."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/mlx-batchd`` where it exists, else a per-user folder in the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and Path(base).is_dir():
        return Path(base) / "mlx-batchd"
    return Path(tempfile.gettempdir()) / f"mlx-batchd-{os.getuid()}"


def default_address() -> str:
    """``$MLX_BATCHD_ADDR`` if set, else the per-user ipc socket."""
    return os.environ.get("MLX_BATCHD_ADDR") or f"ipc://{runtime_dir() / 'daemon.sock'}"
