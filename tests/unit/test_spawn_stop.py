"""``DaemonProcess.stop`` on a child that does not exit at SIGTERM: killed, its code returned, no traceback."""

from __future__ import annotations

import signal
import subprocess
import sys

from scheduler.spawn import DaemonProcess

IGNORES_TERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring', flush=True); time.sleep(120)"
)


def test_a_daemon_that_ignores_sigterm_is_killed_at_the_stop_timeout() -> None:
    daemon = DaemonProcess.__new__(DaemonProcess)
    daemon.proc = subprocess.Popen([sys.executable, "-c", IGNORES_TERM], stdout=subprocess.PIPE, text=True)
    assert daemon.proc.stdout is not None and daemon.proc.stdout.readline().strip() == "ignoring"
    assert daemon.stop(timeout=0.5) == -signal.SIGKILL
    assert daemon.proc.poll() == -signal.SIGKILL
