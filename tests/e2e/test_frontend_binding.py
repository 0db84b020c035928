"""Taking the daemon's addresses: an ipc socket in a folder only its user controls, never another
daemon's live socket, never someone else's socket file at exit; a bad ``--metrics`` address is one
line before anything starts."""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from clients import Client
from scheduler.frontend import BindError, FrontEnd, FrontEndSettings
from tests.conftest import Daemon, start_daemon
from workers.api import Signal
from workers.engine.loop import EngineThread


def _serve(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``mlx-batchd serve`` that is expected to refuse at once (well before a model would load)."""
    return subprocess.run(
        [sys.executable, "-m", "scheduler", "serve", "--model", str(model), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_line_exit_1(out: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert all(w in lines[0] for w in words), lines[0]


def _answers(daemon: Daemon) -> bool:
    with Client(daemon.address) as c:
        return bool(c.health(timeout=30)["status"] == "ready")


def test_a_live_socket_is_refused_and_a_dead_one_replaced(tiny_model: Path, tmp_path: Path) -> None:
    first = start_daemon(tiny_model, tmp_path / "a")
    path = Path(first.address[len("ipc://") :])
    try:
        inode = path.stat().st_ino
        out = _serve(tiny_model, "--listen", first.address)
        _one_line_exit_1(out, "address in use")
        assert path.stat().st_ino == inode  # the file is still the first daemon's
        assert _answers(first)
    finally:
        first.stop(signal.SIGKILL)  # no clean exit: its socket file stays, and nobody listens on it
    assert stat.S_ISSOCK(path.stat().st_mode)
    second = start_daemon(tiny_model, tmp_path / "b", address=first.address)
    try:
        assert _answers(second)
    finally:
        assert second.stop() == 0
    assert not path.exists()  # its own socket, removed at exit


def test_exit_removes_only_its_own_socket_file(tiny_model: Path, tmp_path: Path) -> None:
    """The first daemon's file was replaced (deleted, another daemon bound there): stopping the first
    must leave the second daemon's socket in place."""
    first = start_daemon(tiny_model, tmp_path / "a")
    path = Path(first.address[len("ipc://") :])
    second: Daemon | None = None
    try:
        path.unlink()
        second = start_daemon(tiny_model, tmp_path / "b", address=first.address)
        assert first.stop() == 0
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert _answers(second)
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0


def test_a_folder_others_can_write_is_refused_and_left_as_it_was(tiny_model: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    out = _serve(tiny_model, "--listen", f"ipc://{shared / 'x.sock'}")
    _one_line_exit_1(out, str(shared), "writable by other users")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o777
    assert not (shared / "x.sock").exists()


def test_a_busy_metrics_port_is_one_line_before_the_engine_starts(tiny_model: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _serve(tiny_model, "--listen", f"ipc://{tmp_path / 'a.sock'}", "--metrics", f"127.0.0.1:{port}")
    _one_line_exit_1(out, "--metrics", str(port))
    assert out.returncode != -signal.SIGABRT
    assert not (tmp_path / "a.sock").exists()  # the socket it had bound is gone again


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:99999", "127.0.0.1:", "256.1.1.1:9464"])
def test_an_unusable_metrics_address_is_refused_before_the_engine_exists(tmp_path: Path, address: str) -> None:
    """The front end itself (the command line parses the form first; a program may not)."""
    made: list[object] = []

    def make_engine(emit: Callable[[list[Signal]], None]) -> EngineThread:
        made.append(emit)
        raise AssertionError("the engine must not be made")

    front = FrontEnd(
        FrontEndSettings(listen=f"ipc://{tmp_path / 'c.sock'}", metrics=address, handle_signals=False), make_engine
    )
    with pytest.raises(BindError, match="--metrics") as info:
        anyio.run(front.run, backend="asyncio")
    assert "\n" not in str(info.value) and not made
    assert not (tmp_path / "c.sock").exists()
