"""One Ctrl-C stops ``mlx-batchd generate``: the request is cancelled on the daemon and the command
exits 130, also when the daemon cannot answer any more. The command runs as a real process against
a real daemon, and gets a real SIGINT while tokens stream."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients import Client, EndEvent, TokenEvent
from tests.conftest import Daemon, start_daemon
from tests.e2e.test_cli_errors import FakeDaemon

PROMPT = "hello world"
#: Enough tokens that the request is still running when the signal lands (checked below).
MAX_TOKENS = 3000


@pytest.fixture(scope="module")
def long_daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tiny_model, tmp_path_factory.mktemp("interrupt"), "--max-tokens-cap", str(MAX_TOKENS))
    check_prompt(d.address)
    yield d
    d.stop()


def check_prompt(address: str) -> None:
    """Greedy decoding is deterministic, so what holds here holds for the command's request: text
    shows from the first tokens (a random model may emit bytes that decode to nothing for a while),
    and no end-of-sequence comes early."""
    with Client(address, timeout=120) as c:
        events = list(c.stream(PROMPT, max_tokens=200))
    assert isinstance(events[0], TokenEvent) and events[0].text
    assert isinstance(events[-1], EndEvent) and events[-1].finish_reason == "length"


def _generate_streaming(address: str) -> subprocess.Popen[bytes]:
    """``generate`` as a process, returned once its first output has arrived (tokens are streaming)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "generate", "--addr", address, "--max-tokens", str(MAX_TOKENS), PROMPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdout is not None
    assert p.stdout.read(1), "no tokens streamed"
    return p


def _exit_code_within(p: subprocess.Popen[bytes], seconds: float) -> int:
    try:
        return p.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail(f"generate still running {seconds}s after one SIGINT")


def _in_flight(address: str) -> int:
    with Client(address, timeout=30) as c:
        return int(c.stats()["requests_in_flight"])


def test_one_sigint_cancels_the_request_and_exits_130(long_daemon: Daemon) -> None:
    p = _generate_streaming(long_daemon.address)
    p.send_signal(signal.SIGINT)
    assert _exit_code_within(p, 15) == 130
    assert p.stderr is not None
    err = p.stderr.read().decode()
    assert "Traceback" not in err, err
    assert "[cancelled]" in err, err  # the daemon confirmed the cancel; it did not run to max_tokens
    deadline = time.monotonic() + 10
    while _in_flight(long_daemon.address) != 0:
        assert time.monotonic() < deadline, "the request kept running on the daemon"
        time.sleep(0.05)


def test_one_sigint_exits_130_when_the_daemon_never_confirms(tmp_path: Path) -> None:
    """A daemon that is alive on the wire (it answers heartbeats) but never ends the request, not
    even after the cancel: the command still exits, after a bounded grace."""
    fake = FakeDaemon(f"ipc://{tmp_path / 'fake.sock'}", stall=True)
    try:
        p = _generate_streaming(f"ipc://{tmp_path / 'fake.sock'}")
        p.send_signal(signal.SIGINT)
        assert _exit_code_within(p, 20) == 130
        assert p.stderr is not None
        assert "Traceback" not in p.stderr.read().decode()
        assert fake.submits[0]["id"] in fake.cancels  # it did ask the daemon to stop
    finally:
        fake.close()
