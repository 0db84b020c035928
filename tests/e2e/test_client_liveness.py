"""The client never hangs (issue 13, items 9, 10, 16).

A daemon that dies or stops answering ends every call in flight with ``daemon_gone``; health,
stats and cancel have a default timeout; ``close()`` is prompt from any thread and ends the calls
in flight with ``closed``; a client never closed does not keep its process alive; Ctrl-C during a
stream cancels the request and propagates; ``priority`` reaches the daemon.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import clients.client
from clients import Client, RequestError, TokenEvent
from tests.conftest import Daemon, start_daemon

LONG = 4000  # tokens: about 10 s of decoding for the tiny model, far longer than any check here


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tiny_model, tmp_path_factory.mktemp("liveness"))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture()
def silent_peer(tmp_path: Path) -> Iterator[str]:
    """A ZeroMQ peer that completes the handshake and answers heartbeats but never replies."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path / 'silent.sock'}"
    sock.bind(address)
    yield address
    sock.close()


class Outcomes:
    """Calls run on their own (daemon) threads; each records how it ended: ``ok``, or the
    ``RequestError`` code, or the exception's type name."""

    def __init__(self) -> None:
        self.ended: dict[str, str] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, call: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                call()
                self.ended[name] = "ok"
            except RequestError as exc:
                self.ended[name] = exc.code
            except BaseException as exc:  # recorded, asserted by the test
                self.ended[name] = type(exc).__name__

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def wait(self, within: float) -> dict[str, str]:
        deadline = time.monotonic() + within
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), f"calls still waiting after {within}s: {self.ended}"
        return self.ended


def _stream_after_first_token(client: Client, started: threading.Event, **kwargs: Any) -> Callable[[], None]:
    def consume() -> None:
        for event in client.stream(tokens=[5, 6, 7], max_tokens=LONG, **kwargs):
            if isinstance(event, TokenEvent):
                started.set()

    return consume


def _close_promptly(client: Client, within: float = 5.0) -> float:
    """Close from a helper thread (so a hang fails the test instead of stalling it); its duration."""
    t0 = time.monotonic()
    closer = threading.Thread(target=client.close, daemon=True)
    closer.start()
    closer.join(timeout=within)
    assert not closer.is_alive(), f"close() still blocked after {within}s"
    return time.monotonic() - t0


def test_kill_9_of_the_daemon_ends_calls_in_flight_and_a_restart_is_reached(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path)
    client = Client(d.address)  # no timeout: only the daemon's disappearance can end these calls
    restarted: Daemon | None = None
    try:
        started = threading.Event()
        calls = Outcomes()
        calls.start("stream", _stream_after_first_token(client, started))
        calls.start("generate", lambda: client.generate(tokens=[8, 9], max_tokens=LONG))
        assert started.wait(60)
        d.proc.kill()
        d.proc.wait(timeout=30)
        assert calls.wait(within=20) == {"stream": "daemon_gone", "generate": "daemon_gone"}
        with pytest.raises(RequestError) as info:  # while it is gone, a new call fails at once
            client.health()
        assert info.value.code == "daemon_gone"
        restarted = start_daemon(tiny_model, tmp_path)  # the same address
        client.wait_ready(timeout=60)
        assert client.generate(tokens=[5], max_tokens=3).finish_reason in ("length", "stop")
    finally:
        _close_promptly(client)
        if restarted is not None:
            assert restarted.stop() == 0


def test_a_daemon_that_stops_answering_is_noticed_by_heartbeats(tiny_model: Path, tmp_path: Path) -> None:
    """SIGSTOP keeps the connection open but silent: only the heartbeats can tell."""
    d = start_daemon(tiny_model, tmp_path)
    client = Client(d.address)
    try:
        started = threading.Event()
        calls = Outcomes()
        calls.start("stream", _stream_after_first_token(client, started))
        assert started.wait(60)
        d.proc.send_signal(signal.SIGSTOP)
        calls.start("health", lambda: client.health(timeout=60))
        calls.start("stats", lambda: client.stats(timeout=60))
        assert calls.wait(within=20) == {"stream": "daemon_gone", "health": "daemon_gone", "stats": "daemon_gone"}
    finally:
        d.proc.kill()
        d.proc.send_signal(signal.SIGCONT)
        d.proc.wait(timeout=30)
        _close_promptly(client)


def test_a_connection_that_never_completes_is_not_a_daemon_gone(tmp_path: Path) -> None:
    """A peer that accepts and hangs up before the ZMTP handshake (not a daemon, or one still
    starting) breaks connections that were never up: calls keep waiting, bounded by their timeout."""
    path = tmp_path / "not-zmtp.sock"
    hung_up = threading.Semaphore(0)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen()

        def hang_up() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return  # the listener was closed: the test is over
                conn.close()
                hung_up.release()

        threading.Thread(target=hang_up, daemon=True).start()
        client = Client(f"ipc://{path}")
        try:
            calls = Outcomes()
            calls.start("health", lambda: client.health(timeout=3))
            assert hung_up.acquire(timeout=20) and hung_up.acquire(timeout=20)  # connections broke meanwhile
            assert calls.wait(within=20) == {"health": "TimeoutError"}
        finally:
            _close_promptly(client)
            listener.shutdown(socket.SHUT_RDWR)


def test_health_and_stats_have_a_default_timeout(silent_peer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clients.client, "DEFAULT_CALL_TIMEOUT", 1.0)
    client = Client(silent_peer)
    try:
        calls = Outcomes()
        calls.start("health", client.health)
        calls.start("stats", client.stats)
        assert calls.wait(within=20) == {"health": "TimeoutError", "stats": "TimeoutError"}
    finally:
        _close_promptly(client)


def test_close_from_another_thread_ends_a_stream_and_a_generate_in_flight(daemon: Daemon) -> None:
    client = Client(daemon.address)
    started = threading.Event()
    calls = Outcomes()
    calls.start("stream", _stream_after_first_token(client, started))
    calls.start("generate", lambda: client.generate(tokens=[8, 9], max_tokens=LONG))
    assert started.wait(60)
    assert _close_promptly(client) < 2.0
    assert calls.wait(within=10) == {"stream": "closed", "generate": "closed"}
    with pytest.raises(RequestError) as info:
        client.health()
    assert info.value.code == "closed"


def test_close_ends_calls_waiting_for_a_reply(silent_peer: str) -> None:
    client = Client(silent_peer)
    calls = Outcomes()
    calls.start("health", lambda: client.health(timeout=60))
    calls.start("stats", lambda: client.stats(timeout=60))
    calls.start("stream", lambda: list(client.stream(tokens=[5], max_tokens=5)))
    assert _close_promptly(client) < 2.0
    assert calls.wait(within=10) == {"health": "closed", "stats": "closed", "stream": "closed"}


NEVER_CLOSED = """
import sys
from clients import Client
client = Client(sys.argv[1])
print(client.health()["status"], flush=True)
events = client.stream(tokens=[5, 6, 7], max_tokens=4000)
next(events)  # a stream left in flight as well
print("leaving", flush=True)
"""


def test_a_client_never_closed_does_not_keep_the_process_alive(daemon: Daemon) -> None:
    out = subprocess.run(
        [sys.executable, "-c", NEVER_CLOSED, daemon.address], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ready", "leaving"]


CTRL_C = """
import json, signal, sys, time
from clients import Client, TokenEvent
received = []


def on_sigint(signum, frame):  # the default handler, noting when the signal came
    received.append(time.monotonic())
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, on_sigint)
with Client(sys.argv[1], timeout=30) as client:
    announced = False
    try:
        for event in client.stream(tokens=[5, 6, 7], max_tokens=4000):
            if isinstance(event, TokenEvent) and not announced:
                print("streaming", flush=True)
                announced = True
    except KeyboardInterrupt:
        print("interrupted after", round(time.monotonic() - received[0], 1), flush=True)
        # The connection is still open, so the request ends either by the cancel the stream sent
        # or by running out its tokens; the outcome the daemon counted says which.
        deadline = time.monotonic() + 60
        while client.stats()["requests_in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = client.stats()
        print("in flight", stats["requests_in_flight"], flush=True)
        print("cancelled", stats["outcomes"].get("local", {}).get("cancelled", 0), flush=True)
        print(json.dumps(stats["outcomes"]), flush=True)
        sys.exit(130)
"""


def test_ctrl_c_during_a_stream_cancels_the_request_and_propagates(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path)  # its own, so that nothing else is in flight there
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C, d.address], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "streaming"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 130
        interrupted, in_flight, cancelled, outcomes = proc.stdout.read().splitlines()
        assert interrupted.startswith("interrupted after") and float(interrupted.split()[-1]) < 3.0
        assert in_flight == "in flight 0" and cancelled == "cancelled 1", outcomes
    finally:
        proc.kill()
        proc.wait()
        assert d.stop() == 0


def test_priority_reaches_the_daemon(daemon: Daemon) -> None:
    with Client(daemon.address, timeout=60) as client:
        assert client.generate(tokens=[5, 6], max_tokens=3, priority=7).finish_reason in ("length", "stop")
        with pytest.raises(RequestError) as info:
            client.generate(tokens=[5, 6], max_tokens=3, priority=1001)
        assert info.value.code == "bad_field" and "priority" in info.value.message
