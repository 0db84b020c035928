"""What keeps an engine process from outliving its daemon, and its private folder from outliving both.

- The parent-death signal: on Linux the engine process asks the kernel (``prctl(PR_SET_PDEATHSIG,
  SIGKILL)``) to kill it the moment the thread that started it ends, then checks that its parent
  is still the daemon that started it (a daemon that died before the call left it to another
  parent, and the signal would never come). The kernel needs nothing from the process, so an engine
  stuck holding the GIL (seen in ``mx.clear_cache()``) goes too, where the engine process's own
  polling thread, kept as the fallback on other systems, can never run.
- The command socket's folder (``mlx-batchd-engine-*`` in the temporary directory) records the
  daemon's pid; a daemon removes it on every exit it lives through, and at start removes the folders
  of this user whose daemon is no longer alive (left by a daemon that was killed or crashed).
- SIGTERM: a ready engine process ignores it and waits for its daemon's shutdown command, so a stop
  that signals every process at once (systemd's control group) is a clean one.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("mlx_batchd")

#: Linux's ``prctl`` option that sets the parent-death signal (``<linux/prctl.h>``).
PR_SET_PDEATHSIG = 1
#: The prefix of an engine process's private folder.
FOLDER_PREFIX = "mlx-batchd-engine-"
#: The file in that folder that names the daemon (its pid) that made it.
OWNER_FILE = "daemon.pid"


def die_with_parent(parent: int) -> bool:
    """Have the kernel SIGKILL this process once the thread that started it ends (Linux); ``True``
    when that is set. A parent that is no longer ``parent`` (it died before the call) ends this
    process at once, with a line saying so: the signal would never come."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if not armed:
        log.warning("cannot set the parent-death signal; the engine process watches its daemon by polling")
    if os.getppid() != parent:
        print("mlx-batchd engine: the daemon that started this engine process is gone; exiting", file=sys.stderr)
        os._exit(1)
    return armed


def sigterm_until_ready(ready: threading.Event) -> None:
    """In the engine process: SIGTERM before ``ready`` ends it (the daemon's way to stop a child still
    loading); once ready it is ignored. A control-group stop (systemd) signals the daemon too, whose
    shutdown command then stops the engine cleanly, and a daemon that is gone kills it anyway."""

    def on_term(signum: int, frame: object) -> None:
        if not ready.is_set():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        log.info("SIGTERM ignored: the daemon stops its engine process (signal the daemon)")

    signal.signal(signal.SIGTERM, on_term)


def make_private_folder() -> Path:
    """A new 0700 folder for the engine process's command socket, naming this daemon as its owner;
    stale folders of this user are removed first."""
    remove_stale_folders()
    folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    (folder / OWNER_FILE).write_text(f"{os.getpid()}\n")
    return folder


def remove_stale_folders(root: Path | None = None) -> list[Path]:
    """Remove the engine folders in ``root`` (the temporary directory) that are this user's and
    whose recorded daemon is no longer alive; the removed ones. A folder without an owner file, of
    another user, not a real directory, or whose daemon lives (or cannot be told apart from a live
    process) is left as it is."""
    root = Path(tempfile.gettempdir()) if root is None else root
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(FOLDER_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        owner = _owner(Path(entry.path))
        if owner is None or owner == os.getpid() or _alive(owner):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        log.info("removed %s, left by daemon %d (no longer running)", entry.path, owner)
        removed.append(Path(entry.path))
    return removed


def _owner(folder: Path) -> int | None:
    """The pid written in ``folder``'s owner file, or ``None`` (missing, a link, not a pid)."""
    try:
        fd = os.open(folder / OWNER_FILE, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        text = os.read(fd, 32).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() and int(text) > 0 else None


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
