"""The engine in its own process, in real daemons: it serves exactly, a dead engine process ends
every request with ``engine_dead`` and the daemon with a non-zero exit, and an engine process whose
daemon died does not outlive it. Real daemons, real processes, the tiny model."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from clients import Client
from scheduler.engine_process import EngineProcess
from tests.conftest import start_daemon
from tests.helpers.processes import _alive, _children
from tests.helpers.signals import Recorded
from tests.reference import greedy_reference
from workers.api import Stopped

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds child processes through /proc")


@linux_only
def test_the_engine_runs_in_a_child_and_serves_exactly(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path)
    try:
        children = _children(d.proc.pid)
        assert len(children) == 1, children
        with Client(d.address, timeout=60) as c:
            r = c.generate(tokens=[5, 6, 7], max_tokens=12)
            assert r.tokens == greedy_reference(tiny_model, [5, 6, 7], 12)[0]
            # The snapshot crossed with the end: nothing is left running once the end is read.
            assert c.stats()["engine"]["active_sequences"] == 0
    finally:
        assert d.stop() == 0, d.log()
    assert not any(_alive(p) for p in children)


@linux_only
def test_a_killed_engine_process_ends_every_request_and_the_daemon(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path)
    try:
        (child,) = _children(d.proc.pid)
        with Client(d.address, timeout=60) as c:
            stream = c.stream(tokens=[5, 6, 7], max_tokens=4000)
            next(iter(stream))  # running
            os.kill(child, signal.SIGKILL)
            events = list(stream)
        end = events[-1]
        assert end.finish_reason == "error" and end.error is not None and end.error.code == "engine_dead", end
        assert d.proc.wait(timeout=30) == 1
        assert "engine process exited with code -9" in d.log()
    finally:
        d.stop()


@linux_only
def test_an_engine_process_does_not_outlive_its_daemon(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path)
    (child,) = _children(d.proc.pid)
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while _alive(child):
        assert time.monotonic() < deadline, "the engine process outlived its daemon"
        time.sleep(0.1)


@linux_only
def test_a_shutdown_before_ready_stops_the_engine_process_without_a_word_lost(tiny_model: Path) -> None:
    """A daemon told to stop while its engine process is still starting (on a GPU host, loading and
    checking kernels for minutes; here, before the child has even connected its command socket): the
    child is terminated, the handle's final word is ``Stopped`` (the daemon exits 0), no ``Ready``."""
    emit = Recorded()
    got, final = emit.got, emit.final
    handle = EngineProcess(str(tiny_model), None, emit)
    handle.start()
    child = handle._proc
    assert child is not None
    handle.shutdown()  # at once: the child is still importing, with no command socket connected
    assert final.wait(30), got
    # A command after the child is gone has no one to reach, and is not an error either.
    handle.cancel(1)
    handle.join(10)
    assert [type(s) for s in got] == [Stopped]
    assert child.returncode == -signal.SIGTERM
