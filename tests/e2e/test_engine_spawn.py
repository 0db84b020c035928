"""The engine process started before the daemon's own checks (``scheduler.engine_spawn``): a start refused
after it began ends it, and one that never gets its settings exits with one line. Real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.daemon import DaemonSettings, serve
from scheduler.engine_process import EngineProcess
from scheduler.engine_spawn import spawn
from scheduler.frontend import FrontEndSettings
from tests.helpers.signals import Recorded
from workers.api import Dead
from workers.models.loading import ModelError


def test_a_refused_start_ends_the_engine_process_it_started(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown-arch"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_architecture", "vocab_size": 8}))
    (unknown / "model.safetensors").write_bytes(b"")
    spawned = spawn()
    try:
        settings = DaemonSettings(FrontEndSettings(f"ipc://{tmp_path / 'd.sock'}"), model=str(unknown))
        with pytest.raises(ModelError, match="no_such_architecture"):
            serve(settings, spawned)
        assert spawned.proc.poll() is not None  # ended, not left importing or waiting for settings
        assert not (tmp_path / "d.sock").exists()
    finally:
        if spawned.proc.poll() is None:
            spawned.proc.kill()
            spawned.proc.wait()


def test_an_engine_process_without_settings_exits_with_one_line() -> None:
    """Its daemon died before sending them (the engine process is started before they are known)."""
    run = subprocess.run(
        [sys.executable, "-m", "scheduler.engine_child", "1", "0"], input=b"", capture_output=True, timeout=120
    )
    err = run.stderr.decode()
    assert run.returncode == 1, err
    assert err == "mlx-batchd engine: the daemon sent no settings; exiting\n"


def test_an_engine_process_gone_before_its_settings_is_reported_dead(tiny_model: Path) -> None:
    """Started early, it died while importing (a broken install): the daemon hears ``Dead`` from the
    pipe's end, and sending the settings to nobody raises nothing into the daemon."""
    spawned = spawn()
    spawned.proc.kill()
    spawned.proc.wait()
    emit = Recorded()
    handle = EngineProcess(str(tiny_model), None, emit, spawned=spawned)
    handle.start()
    assert emit.final.wait(60), emit.got
    handle.join(10)
    assert [type(s) for s in emit.got] == [Dead], emit.got
    assert "exited with code -9" in emit.got[0].error
