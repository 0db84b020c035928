"""A reader that is alive but slow gets back-pressure (its sequences paused), never a cut; a peer that
falls silent past the heartbeat time-to-live it asked for is dropped and its requests end
``disconnected``; a connection that stops reading gives its decode slot to others and gets it back when
it reads again."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from clients import Client
from clients.protocol import PROTOCOL_VERSION, pack, unpack
from tests.conftest import start_daemon
from tests.reference import greedy_reference

SLOW_READ_S = 0.05
SLOW_FOR_S = 15.0


class _Watch:
    """Polls ``stats`` from its own connection and keeps the largest values seen."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.peak: dict[str, int] = {"clients_paused": 0, "paused_sequences": 0, "unsent_messages": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with Client(self.address, timeout=60) as c:
            while not self._stop.is_set():
                s = c.stats()
                for key, value in (
                    ("clients_paused", s["clients_paused"]),
                    ("paused_sequences", s["engine"].get("paused", 0)),
                    ("unsent_messages", s["unsent_messages"]),
                ):
                    self.peak[key] = max(self.peak[key], value)
                time.sleep(0.05)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def test_a_slow_reader_gets_every_token_and_its_end_while_paused_not_cut(tiny_model: Path, tmp_path: Path) -> None:
    """One message every 50 ms, far slower than the model: its queues fill, the daemon pauses its
    sequence instead of dropping it, and resumes it as they drain. For 15 s it stays hundreds of
    messages behind; it sends its own heartbeats (as the client library does), so it is never cut. Then it
    reads the rest at full speed, to keep the test short."""
    max_tokens = 1200
    d = start_daemon(tiny_model, tmp_path, "--max-unsent-per-client", "20")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    slow = ctx.socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 10)
    slow.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    slow.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3_600_000)  # its own patience is not what is tested here
    slow.connect(d.address)
    submit = {"v": PROTOCOL_VERSION, "type": "submit", "id": "long", "tokens": [5, 6, 7], "max_tokens": max_tokens}
    try:
        with _Watch(d.address) as watch:
            slow.send(pack(submit))
            slow_until = time.monotonic() + SLOW_FOR_S
            tokens: list[int] = []
            while True:
                assert slow.poll(30_000), "the stream stopped"
                msg: dict[str, Any] = unpack(slow.recv(), 1 << 30)
                assert msg["id"] == "long", msg
                if msg["type"] == "end":
                    break
                tokens += msg["tokens"]
                if time.monotonic() < slow_until or not watch.peak["paused_sequences"]:
                    time.sleep(SLOW_READ_S)
            assert time.monotonic() > slow_until  # the slow part really lasted that long
        assert msg["finish_reason"] == "length" and "error" not in msg, msg
        assert tokens == greedy_reference(tiny_model, [5, 6, 7], max_tokens)[0]
        assert watch.peak["clients_paused"] == 1 and watch.peak["paused_sequences"] == 1, watch.peak
        with Client(d.address, timeout=60) as c:
            after = c.stats()
        assert after["clients_dropped"] == 0 and after["clients_paused"] == 0 and after["unsent_messages"] == 0
        assert "disconnected" not in after["outcomes"]["local"]
    finally:
        slow.close()
        ctx.destroy(linger=0)  # closes whatever a failed assertion left open
        assert d.stop() == 0


SILENT_CLIENT = """
import sys, time, zmq
from clients.protocol import PROTOCOL_VERSION, pack
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.HEARTBEAT_IVL, 100)  # PINGs, as the client library sends, that ask the daemon
sock.setsockopt(zmq.HEARTBEAT_TTL, 6000)  # to drop this connection after 6 s without traffic
sock.connect(sys.argv[1])
sock.send(pack({"v": PROTOCOL_VERSION, "type": "submit", "id": "w", "tokens": [9, 9], "max_tokens": 20}))
time.sleep(0.5)  # the daemon arms the TTL on the first PING, sent 0.1 s after the handshake
print("sent", flush=True)
sock.recv()  # never comes while the blocker holds the slot
"""


def test_a_silent_peer_is_dropped_and_its_request_ends_disconnected(tiny_model: Path, tmp_path: Path) -> None:
    """A client process that asked for a heartbeat time-to-live (the client library does) and is stopped
    with SIGSTOP sends nothing more; after the TTL its waiting request ends ``disconnected``, counted
    per tenant and in ``clients_dropped``. (The daemon sends no heartbeats of its own: see
    ``scheduler.transport``; a peer that asked for none is parked once it stops reading.)"""
    d = start_daemon(tiny_model, tmp_path, "--max-batch", "1")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    blocker = ctx.socket(zmq.DEALER)
    blocker.setsockopt(zmq.LINGER, 0)
    blocker.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    blocker.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3_600_000)
    blocker.connect(d.address)
    silent = subprocess.Popen([sys.executable, "-c", SILENT_CLIENT, d.address], stdout=subprocess.PIPE, text=True)
    try:
        blocker.send(pack({"v": PROTOCOL_VERSION, "type": "submit", "id": "b", "tokens": [5], "max_tokens": 4000}))
        assert blocker.poll(30_000)  # decoding (it then pauses: this test does not read it)
        assert silent.stdout is not None and silent.stdout.readline().strip() == "sent"
        with Client(d.address, timeout=60) as c:
            deadline = time.monotonic() + 30
            while c.stats()["requests_waiting"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            silent.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + 60
            while "disconnected" not in c.stats()["outcomes"].get("local", {}):
                assert time.monotonic() < deadline, c.stats()
                time.sleep(0.1)
            stats = c.stats()
        assert stats["outcomes"]["local"]["disconnected"] == 1 and stats["clients_dropped"] == 1
        assert stats["requests_waiting"] == 0
    finally:
        silent.kill()
        silent.wait(timeout=30)
        blocker.close()
        ctx.destroy(linger=0)  # closes whatever a failed assertion left open
        assert d.stop() == 0


def test_a_connection_that_stops_reading_gives_its_slot_back_and_resumes_byte_exact(
    tiny_model: Path, tmp_path: Path
) -> None:
    """One decode slot. A reader that stops reading mid-stream is paused, then parked after
    ``--park-after``: another client is served meanwhile. When the reader reads again its stream
    resumes where it was and is byte-exact to the end."""
    max_tokens = 600
    d = start_daemon(tiny_model, tmp_path, "--max-batch", "1", "--max-unsent-per-client", "20", "--park-after", "1")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    stalled = ctx.socket(zmq.DEALER)
    stalled.setsockopt(zmq.LINGER, 0)
    stalled.setsockopt(zmq.RCVHWM, 10)
    stalled.connect(d.address)
    submit = {"v": PROTOCOL_VERSION, "type": "submit", "id": "s", "tokens": [5, 6, 7], "max_tokens": max_tokens}
    try:
        stalled.send(pack(submit))
        assert stalled.poll(30_000)  # streaming; from here it reads nothing for a while
        with Client(d.address, timeout=60) as c:
            deadline = time.monotonic() + 60
            while c.stats()["sequences_parked"] != 1:  # paused at once, parked after --park-after
                assert time.monotonic() < deadline, c.stats()
                time.sleep(0.05)
            other = c.generate(tokens=[3, 4, 5], max_tokens=16, temperature=0.0)
        assert other.tokens == greedy_reference(tiny_model, [3, 4, 5], 16)[0]
        tokens: list[int] = []
        while True:
            assert stalled.poll(30_000), "the stream did not resume"
            msg: dict[str, Any] = unpack(stalled.recv(), 1 << 30)
            if msg["type"] == "end":
                break
            tokens += msg["tokens"]
        assert msg["finish_reason"] == "length" and "error" not in msg, msg
        assert tokens == greedy_reference(tiny_model, [5, 6, 7], max_tokens)[0]
    finally:
        stalled.close()
        ctx.destroy(linger=0)
        assert d.stop() == 0
