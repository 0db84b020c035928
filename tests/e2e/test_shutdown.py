"""Signals with requests in flight: every client hears why, and the daemon exits 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from clients import Client, EndEvent, TokenEvent
from tests.conftest import start_daemon


def _stream_into(address: str, results: list[Any], started: threading.Semaphore, max_tokens: int) -> None:
    with Client(address, timeout=120) as c:
        got: list[int] = []
        for event in c.stream(tokens=[5, 6, 7], max_tokens=max_tokens):
            if isinstance(event, TokenEvent):
                if not got:
                    started.release()
                got.extend(event.tokens)
            elif isinstance(event, EndEvent):
                results.append((event, len(got)))


def _streams_started(address: str, n: int, max_tokens: int) -> tuple[list[Any], list[threading.Thread]]:
    """``n`` streaming requests on their own threads, returned once each has its first token."""
    results: list[Any] = []
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=_stream_into, args=(address, results, started, max_tokens)) for _ in range(n)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60)
    return results, threads


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_with_requests_in_flight(tiny_model: Path, tmp_path: Path, sig: int) -> None:
    daemon = start_daemon(tiny_model, tmp_path)
    results, threads = _streams_started(daemon.address, 4, 4000)
    assert daemon.stop(sig) == 0, daemon.log()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 4
    for end, _ in results:
        assert end.finish_reason == "error"
        assert end.error is not None and end.error.code == "shutdown"
    assert not (tmp_path / "daemon.sock").exists()


def test_drain_lets_in_flight_requests_finish(tiny_model: Path, tmp_path: Path) -> None:
    daemon = start_daemon(tiny_model, tmp_path, "--drain-timeout", "60")
    results, threads = _streams_started(daemon.address, 3, 150)
    daemon.proc.send_signal(signal.SIGTERM)
    with Client(daemon.address, timeout=30) as c:
        late = list(c.stream(tokens=[1, 2], max_tokens=5))
    assert isinstance(late[-1], EndEvent) and late[-1].error is not None and late[-1].error.code == "shutdown"
    assert daemon.proc.wait(timeout=120) == 0, daemon.log()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 3
    for end, n in results:
        assert end.finish_reason in ("length", "stop") and end.error is None
        assert end.usage["completion_tokens"] == n


def test_missing_model_exits_nonzero_with_a_reason(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler",
            "serve",
            "--model",
            str(tmp_path / "nope"),
            "--listen",
            f"ipc://{tmp_path / 's'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "not a model directory" in out.stdout + out.stderr
