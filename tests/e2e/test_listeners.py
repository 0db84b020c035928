"""The daemon's HTTP listeners (``--http`` and ``--metrics``) against real daemons and raw sockets:
idle and incomplete connections are closed, connections past the cap are refused at once while the
ZeroMQ door keeps serving, the descriptor limit is raised to the hard limit, the exposition bytes are
prometheus_client's own, and a non-loopback ``--metrics`` needs ``--insecure``."""

from __future__ import annotations

import gzip
import json
import resource
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from clients import Client
from scheduler.exposition import metrics_app
from scheduler.http_limits import HEAD_TIMEOUT_S, ListenerLimits, connection_cap
from scheduler.http_server import bind, serve_app
from tests.conftest import Daemon, start_daemon
from tests.e2e.test_http import http_url, wait_until
from tests.e2e.test_http_auth import mlx_batchd
from tests.e2e.test_metrics import _free_port

#: Seconds a test waits for the daemon to close a connection: far beyond every deadline it enforces.
CLOSE_WITHIN_S = 30.0
#: The soft descriptor limit the listener daemon is started with (it must raise it to the hard limit).
STARTED_SOFT = 1024


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def connect(port: int, sent: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=CLOSE_WITHIN_S)
    if sent:
        sock.sendall(sent)
    return sock


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything the daemon sends until it closes the connection (an assertion error if it does not
    within ``CLOSE_WITHIN_S``)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the daemon left the connection open; it sent {got!r}") from None
    finally:
        sock.close()
    return got


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with both listeners, started with a soft descriptor limit below its hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(STARTED_SOFT, hard), hard))  # the daemon inherits it
    try:
        d = start_daemon(
            tiny_model,
            tmp_path_factory.mktemp("listeners"),
            "--http",
            "127.0.0.1:0",
            "--metrics",
            f"127.0.0.1:{_free_port()}",
            "--http-body-timeout",
            "1",
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    yield d
    assert d.stop() == 0, d.log()


def metrics_port(d: Daemon) -> int:
    return int(d.process.cmd[d.process.cmd.index("--metrics") + 1].rsplit(":", 1)[1])


def test_idle_and_incomplete_connections_are_closed(daemon: Daemon) -> None:
    """Nothing sent, a request line and one header, an idle kept-alive connection, a body trickled
    after the answer: the daemon closes each, on both listeners, however long the client waits."""
    http, metrics = port_of(http_url(daemon)), metrics_port(daemon)
    trickling = connect(http, b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
    stop = threading.Event()

    def trickle() -> None:  # one byte at a time, far more often than any deadline
        while not stop.wait(0.2):
            try:
                trickling.send(b"x")
            except OSError:
                return

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    idle = {
        "http, nothing sent": connect(http),
        "http, half a head": connect(http, b"GET /health HTTP/1.1\r\nHost: x\r\n"),
        "http, kept alive": connect(http, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"),
        "metrics, nothing sent": connect(metrics),
        "metrics, half a head": connect(metrics, b"GET /metrics HTTP/1.1\r\n"),
    }
    try:
        got = {what: read_to_eof(sock) for what, sock in idle.items()}
        answered = read_to_eof(trickling)
    finally:
        stop.set()
        sender.join()
    assert got["http, kept alive"].startswith(b"HTTP/1.1 200")  # answered, then closed once idle
    assert b"HTTP/1.1" not in got["http, nothing sent"] + got["metrics, nothing sent"]
    assert answered.startswith(b"HTTP/1.1 405")  # /health is GET only: answered, then closed mid-body
    assert httpx.get(f"{http_url(daemon)}/health").status_code == 200  # the listener is fine


def test_the_descriptor_limit_is_raised_to_the_hard_limit(daemon: Daemon) -> None:
    """Started with a soft limit below its hard limit (and mlx-lm's import setting (2048, 4096)), the
    daemon runs with soft = hard = the hard limit it was started with."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    line = next(
        line for line in Path(f"/proc/{daemon.proc.pid}/limits").read_text().splitlines() if "open files" in line
    )
    soft_now, hard_now = (int(v) for v in line.split()[3:5])
    assert (soft_now, hard_now) == (hard, hard), line


def test_connections_past_the_cap_are_refused_at_once_and_zeromq_is_served(tiny_model: Path, tmp_path: Path) -> None:
    """With `--http-max-connections 8` and 8 connections held (bodies owed), 24 more are answered
    503 `too_many_connections` and closed at once; a ZeroMQ client is served meanwhile, and an HTTP
    client once the held ones are gone."""
    cap = 8
    d = start_daemon(
        tiny_model, tmp_path, "--http", "127.0.0.1:0", "--http-max-connections", str(cap), "--http-body-timeout", "600"
    )
    try:
        url = http_url(d)
        port = port_of(url)
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n"
        )
        held = [connect(port, head) for _ in range(cap)]
        refused = [read_to_eof(connect(port)) for _ in range(24)]
        for answer in refused:
            assert answer.startswith(b"HTTP/1.1 503"), answer
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        with Client(d.address, timeout=60) as c:
            assert c.generate(tokens=[5, 6, 7], max_tokens=4).finish_reason == "length"
        for sock in held:
            sock.close()

        def served() -> bool:
            return httpx.get(f"{url}/health").status_code == 200

        wait_until(served, "an HTTP request served once the held connections closed")
    finally:
        assert d.stop() == 0, d.log()


def test_the_cap_fits_the_descriptor_limit() -> None:
    """Below a low descriptor limit the HTTP cap is lowered, keeping a reserve for ZeroMQ."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(300, hard), hard))
    try:
        cap = connection_cap(1024, others=16)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert 1 <= cap <= min(300, hard) - 64 - 16


def test_the_exposition_bytes_are_prometheus_clients_own(daemon: Daemon) -> None:
    """The daemon's exposition server answers what prometheus_client's own server answers for the
    same registry: plain text, OpenMetrics, gzip."""
    with Client(daemon.address, timeout=60) as c:
        c.generate(tokens=[5, 6, 7], max_tokens=4)
        snapshot = c.stats()
    registry = CollectorRegistry()
    Counter("demo_events", "Events", ["kind"], registry=registry).labels("a").inc(3)
    app = metrics_app(lambda: snapshot, registry)
    reference, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    asks = [{}, {"Accept": "application/openmetrics-text; version=1.0.0"}, {"Accept-Encoding": "gzip"}]

    def fetch(port: int, headers: dict[str, str]) -> tuple[int, str, str, bytes]:
        """Status, type, encoding and body (unzipped: gzip's header holds the time it was made)."""
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as r:
            encoding, body = r.headers.get("Content-Encoding", ""), r.read()
            return r.status, r.headers["Content-Type"], encoding, gzip.decompress(body) if encoding else body

    async def main() -> list[tuple[int, str, str, bytes]]:
        sock, stop = bind("127.0.0.1:0"), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_app, app, sock, stop, ListenerLimits(4, HEAD_TIMEOUT_S))
            ours = [await anyio.to_thread.run_sync(fetch, sock.getsockname()[1], h) for h in asks]
            stop.set()
        return ours

    try:
        ours = anyio.run(main)
        theirs = [fetch(reference.server_port, h) for h in asks]
    finally:
        reference.shutdown()
    assert ours == theirs
    assert [encoding for _, _, encoding, _ in ours] == ["", "", "gzip"]
    assert b"mlx_batchd_requests_in_flight" in ours[0][3] and b"demo_events_total" in ours[0][3]


def test_non_loopback_metrics_needs_insecure(tiny_model: Path, tmp_path: Path) -> None:
    port = _free_port()
    base = ["serve", "--model", str(tiny_model), "--listen", f"ipc://{tmp_path / 's' / 'd.sock'}"]
    out = mlx_batchd(*base, "--metrics", f"0.0.0.0:{port}")
    assert out.returncode == 2, out.stderr
    assert "--insecure" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    d = start_daemon(tiny_model, tmp_path / "insecure", "--metrics", f"0.0.0.0:{port}", "--insecure")
    try:
        assert "INSECURE: --metrics" in d.log()
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
    finally:
        assert d.stop() == 0, d.log()
