"""The CPU seconds a process (or one of its threads) has used, the CPU it last ran on, and a daemon's processes, from Linux's
``/proc``: for the probes that split a request's cost between the client, the front end and the engine
process. ``None`` where there is no ``/proc`` (macOS)."""

from __future__ import annotations

import os
from pathlib import Path


def _stat(pid: int, tid: int | None) -> list[str] | None:
    """The fields of ``/proc``'s ``stat`` after the command name (field 3 first); ``None`` without it."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (all its threads), or of its thread ``tid``."""
    fields = _stat(pid, tid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def last_cpu(pid: int, tid: int | None = None) -> int | None:
    """The CPU process ``pid`` (or its thread ``tid``) last ran on (field 39)."""
    fields = _stat(pid, tid)
    return None if fields is None else int(fields[36])


def daemon_processes(daemon_pid: int) -> dict[str, int]:
    """The front end (the daemon) and its engine process (its one child, where it has one)."""
    found = {"front_end": daemon_pid}
    try:
        kids = Path(f"/proc/{daemon_pid}/task/{daemon_pid}/children").read_text().split()
    except OSError:
        kids = []
    if kids:
        found["engine_process"] = int(kids[0])
    return found
