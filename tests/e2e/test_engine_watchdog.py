"""The daemon and its engine process cannot outlive or outwait each other, in real daemons.

A stopped engine process (SIGSTOP: a stand-in for a hung kernel) with work pending is declared dead
after ``engine_timeout``: the request ends ``engine_dead``, health turns ``engine_dead`` (HTTP 503),
the daemon exits 1 and the engine process is gone; the same stop while idle is no death. A daemon
killed while its engine process is stopped (its polling thread cannot run) takes the engine process
with it (the parent-death signal). Engine folders left by dead daemons are removed at start; a live
daemon's is kept."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clients import Client, EndEvent
from scheduler.engine_lifetime import FOLDER_PREFIX, OWNER_FILE
from tests.conftest import Daemon, start_daemon
from tests.helpers.processes import _alive, _children

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal, /proc")

#: Seconds any process here may take to go once it should.
GONE_S = 30.0


def _wait_gone(pid: int, timeout: float = GONE_S) -> bool:
    """Whether ``pid`` is gone within ``timeout`` (polls its existence; returns at once when gone)."""
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _http_url(d: Daemon) -> str:
    found = re.search(r"OpenAI-compatible API at (http://\S+)/v1", d.log())
    assert found, d.log()
    return found.group(1)


@pytest.fixture()
def short_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short private temporary directory for the daemons' engine folders (ipc paths are short)."""
    path = Path(tempfile.mkdtemp(prefix="mbw-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@linux_only
def test_a_stopped_engine_with_work_pending_is_declared_dead(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path, "--engine-timeout", "3", "--http", "127.0.0.1:0")
    (child,) = _children(d.proc.pid)
    try:
        url = _http_url(d)
        with Client(d.address, timeout=30) as c:  # bounds the stream: a missed hang fails, never waits
            stream = iter(c.stream(tokens=[5, 6, 7], max_tokens=4000))
            next(stream)  # decoding
            os.kill(child, signal.SIGSTOP)
            events = list(stream)
            end = events[-1]
            assert isinstance(end, EndEvent) and end.error is not None and end.error.code == "engine_dead", end
            # Until it exits, the daemon says why on both doors.
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "engine_dead", health.text
            assert c.health()["status"] == "engine_dead"
        assert d.proc.wait(timeout=GONE_S) == 1, d.log()
        assert _wait_gone(child), "the hung engine process outlived its daemon"
        assert "presumed hung" in d.log() and "engine_timeout = 3 in the config file" in d.log(), d.log()
    finally:
        _kill(child)
        d.stop()


@linux_only
def test_an_idle_engine_stopped_past_the_timeout_is_not_declared_dead(tiny_model: Path, tmp_path: Path) -> None:
    """Nothing pending (a request ran to its end first): the engine owes no word, so silence is fine."""
    d = start_daemon(tiny_model, tmp_path, "--engine-timeout", "1")
    (child,) = _children(d.proc.pid)
    try:
        with Client(d.address, timeout=60) as c:
            assert c.generate(tokens=[5, 6, 7], max_tokens=8).finish_reason == "length"
            os.kill(child, signal.SIGSTOP)
            time.sleep(3.5)  # three times the limit: a watchdog that counted idle time would have fired
            assert d.proc.poll() is None, d.log()
            assert c.health()["status"] == "ready"
            os.kill(child, signal.SIGCONT)
            assert c.generate(tokens=[5, 6, 7], max_tokens=8).finish_reason == "length"
        assert "presumed hung" not in d.log()
    finally:
        if _alive(child):
            os.kill(child, signal.SIGCONT)
        assert d.stop() == 0, d.log()


@linux_only
def test_a_stopped_engine_process_dies_with_its_killed_daemon(
    tiny_model: Path, tmp_path: Path, short_tmpdir: Path
) -> None:
    """The engine process's polling thread cannot run (stopped, as when it hangs holding the GIL):
    the kernel's parent-death signal ends it anyway."""
    d = start_daemon(tiny_model, tmp_path)
    (child,) = _children(d.proc.pid)
    try:
        os.kill(child, signal.SIGSTOP)
        d.proc.kill()
        d.proc.wait(timeout=GONE_S)
        assert _wait_gone(child), "the stopped engine process outlived its daemon"
    finally:
        _kill(child)
    # A killed daemon leaves its folder behind (nothing of it runs to remove it): the next start does.
    (left,) = list(short_tmpdir.glob(f"{FOLDER_PREFIX}*"))
    assert (left / OWNER_FILE).read_text().strip() == str(d.proc.pid)


@linux_only
def test_engine_folders_of_dead_daemons_are_removed_at_start_and_live_ones_kept(
    tiny_model: Path, tmp_path: Path, short_tmpdir: Path
) -> None:
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()  # reaped: no process has this pid now
    stale, live, unowned = (short_tmpdir / f"{FOLDER_PREFIX}{n}" for n in ("stale", "live", "unowned"))
    for folder in (stale, live, unowned):
        folder.mkdir(mode=0o700)
        (folder / "commands").write_text("")
    (stale / OWNER_FILE).write_text(f"{dead_pid.pid}\n")
    (live / OWNER_FILE).write_text(f"{os.getpid()}\n")
    d = start_daemon(tiny_model, tmp_path)
    try:
        assert not stale.exists(), "a dead daemon's engine folder was left"
        assert live.exists() and unowned.exists()
        (own,) = set(short_tmpdir.glob(f"{FOLDER_PREFIX}*")) - {live, unowned}
        assert (own / OWNER_FILE).read_text().strip() == str(d.proc.pid)
    finally:
        assert d.stop() == 0, d.log()
    assert not own.exists(), "the daemon left its engine folder behind"
    assert "removed" in d.log() and f"daemon {dead_pid.pid}" in d.log()


@linux_only
def test_sigterm_to_the_daemon_and_its_engine_process_at_once_is_a_clean_stop(tiny_model: Path, tmp_path: Path) -> None:
    """What systemd's control-group stop does: the engine process, once ready, leaves its stop to
    the daemon, whose shutdown ends the stream ``shutdown`` and exits 0."""
    d = start_daemon(tiny_model, tmp_path)
    (child,) = _children(d.proc.pid)
    try:
        with Client(d.address, timeout=30) as c:
            stream = iter(c.stream(tokens=[5, 6, 7], max_tokens=4000))
            next(stream)
            os.kill(child, signal.SIGTERM)
            os.kill(d.proc.pid, signal.SIGTERM)
            end = list(stream)[-1]
        assert isinstance(end, EndEvent) and end.error is not None and end.error.code == "shutdown", end
        assert d.proc.wait(timeout=GONE_S) == 0, d.log()
        assert _wait_gone(child)
    finally:
        _kill(child)
        d.stop()
