"""Where the daemon listens by default, and whether an ``ipc://`` path is safe to use.

The default is an ``ipc://`` socket private to the user. Without ``XDG_RUNTIME_DIR`` it lives under
the shared temp dir, where another local user could create the folder first and bind a fake daemon
there; so the daemon creates its folder itself (mode 0700) and both sides refuse a folder that is
not owned by the current user or that others can write.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from clients import envs

IPC_PREFIX = "ipc://"


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/mlx-batchd`` where it exists, else a per-user folder in the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and Path(base).is_dir():
        return Path(base) / "mlx-batchd"
    return Path(tempfile.gettempdir()) / f"mlx-batchd-{os.getuid()}"


def default_address() -> str:
    """``$MLX_BATCHD_ADDR`` if set, else the per-user ipc socket."""
    return envs.addr() or f"{IPC_PREFIX}{runtime_dir() / 'daemon.sock'}"


def ipc_path(address: str) -> Path | None:
    """The socket file of an ``ipc://`` address, or ``None`` for other transports."""
    return Path(address[len(IPC_PREFIX) :]) if address.startswith(IPC_PREFIX) else None


def unsafe_reason(folder: Path) -> str | None:
    """Why ``folder`` must not hold a socket we talk through, or ``None`` if it is safe.

    Safe means: it exists, is a real directory (not a symlink), is owned by the current user,
    and neither group nor others may write to it (so nobody else can put a socket there or
    replace ours).
    """
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return f"{folder} does not exist"
    except OSError as exc:
        return f"cannot inspect {folder}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{folder} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a directory"
    if st.st_uid != os.getuid():
        return f"{folder} is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{folder} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None
