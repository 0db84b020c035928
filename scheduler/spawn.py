"""Starting a daemon as a child process and waiting for its ready handshake.

Used by ``mlx-batchd demo``, the benchmarks and the tests, so all of them exercise the daemon
exactly as a user runs it: a separate process behind a real socket.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from clients.sync import Client


class DaemonExited(RuntimeError):
    """The child exited before it was ready. Its own stderr (inherited, or the log) says why."""


class DaemonProcess:
    """A ``mlx-batchd serve`` child process. ``stop()`` sends SIGTERM and returns the exit code."""

    def __init__(
        self,
        model: str | Path,
        address: str,
        *extra: str,
        log: IO[str] | None = None,
        client_kwargs: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``client_kwargs`` are what a client needs to be let in (CURVE keys) for the handshake;
        ``env``: variables set for this daemon on top of this process's environment."""
        self.address = address
        self.client_kwargs = client_kwargs or {}
        self.cmd = [sys.executable, "-m", "scheduler", "serve", "--model", str(model), "--listen", address, *extra]
        kwargs: dict[str, Any] = {"env": {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, "text": True}
        if log is not None:
            kwargs.update(stdout=log, stderr=subprocess.STDOUT)
        #: ``time.monotonic()`` at the spawn, and seconds from it to health answering ``ready``
        #: (``None`` until ``wait_ready`` saw it): what the bench reports as a daemon's start-up.
        self.spawned_at = time.monotonic()
        self.ready_seconds: float | None = None
        self.proc = subprocess.Popen(self.cmd, **kwargs)

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """Poll health until ``ready``; fail fast if the process dies first."""
        deadline = time.monotonic() + timeout
        with Client(self.address, **self.client_kwargs) as client:
            while True:
                if self.proc.poll() is not None:
                    raise DaemonExited(f"the daemon exited with {self.proc.returncode} before it was ready")
                try:
                    health = client.wait_ready(timeout=1.0)
                    if self.ready_seconds is None:
                        self.ready_seconds = time.monotonic() - self.spawned_at
                    return health
                except TimeoutError:
                    if time.monotonic() > deadline:
                        self.proc.kill()
                        raise

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` and wait up to ``timeout`` s for the exit; a daemon still running then is
        killed (its code is then ``-SIGKILL``) rather than left behind."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> DaemonProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
