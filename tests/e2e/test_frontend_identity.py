"""A connection that reuses another's ZeroMQ routing id gets nothing of the other's requests.

libzmq's ROUTER numbers the connections it names itself from a fixed start (the first one of a daemon
is ``00 6b 8b 45 67``, glibc's first ``rand()``), and a client may name itself with any id, leading
zero byte included; a duplicate of a live id is ignored, but once the first connection is gone its id
is free. So the attack is: wait for the victim to disconnect, connect with its id, and read or cancel
whatever the daemon still holds for that id.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import zmq

from clients import Client
from clients.protocol import PROTOCOL_VERSION, pack, unpack
from tests.conftest import start_daemon


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], address: str, routing_id: bytes | None = None) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(address)
    return sock


def _send(sock: zmq.Socket[bytes], **msg: Any) -> None:
    sock.send(pack({"v": PROTOCOL_VERSION, **msg}))


def _recv(sock: zmq.Socket[bytes], timeout_ms: int = 30_000) -> dict[str, Any] | None:
    if not sock.poll(timeout_ms):
        return None
    return unpack(sock.recv(), 1 << 30)


def _wait(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _take_over(ctx: zmq.Context[zmq.Socket[bytes]], address: str, routing_id: bytes) -> zmq.Socket[bytes]:
    """Connect with ``routing_id`` until the daemon answers under it. A connection made while the old
    one still looked live is parked by libzmq, which then takes its first message as its id; such an
    attempt gets no answer and is replaced."""
    for attempt in range(50):
        sock = _dealer(ctx, address, routing_id)
        _send(sock, type="health", id=f"probe-{attempt}")
        reply = _recv(sock, 1000)
        if reply is not None and reply["id"] == f"probe-{attempt}":
            return sock
        sock.close()
    raise AssertionError("never got the routing id")


def test_a_reused_routing_id_cannot_read_or_cancel_the_previous_connections_requests(
    tiny_model: Path, tmp_path: Path
) -> None:
    d = start_daemon(tiny_model, tmp_path, "--max-batch", "1")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    victim_id = b"\x00" + os.urandom(4)  # shaped like an id the ROUTER gives out itself
    try:
        with Client(d.address, timeout=60) as observer:
            blocker = _dealer(ctx, d.address)  # holds the one decode slot: the victim's requests wait
            _send(blocker, type="submit", id="block", tokens=[5, 6, 7], max_tokens=4000)
            assert _recv(blocker) is not None  # its first token: it is decoding
            victim = _dealer(ctx, d.address, victim_id)
            for rid in ("v1", "v2"):
                _send(victim, type="submit", id=rid, tokens=[9, 10, 11], max_tokens=50)
            _wait(lambda: observer.stats()["requests_waiting"] == 2, "the victim's requests are queued")
            victim.close()

            attacker = _take_over(ctx, d.address, victim_id)
            _send(attacker, type="cancel", id="v1")
            refusal = _recv(attacker)
            assert refusal is not None and refusal["type"] == "error", refusal
            assert refusal["code"] == "unknown_request_id" and refusal["id"] == "v1"

            _send(blocker, type="cancel", id="block")  # free the slot: anything still held for v1/v2 would run now
            _wait(
                lambda: (
                    observer.stats()["requests_in_flight"] == 0 and observer.stats()["engine"]["active_sequences"] == 0
                ),
                "everything ended",
            )
            _send(attacker, type="health", id="last")
            seen = []
            while (msg := _recv(attacker)) is not None and msg["id"] != "last":
                seen.append(msg)
            assert seen == []  # nothing of v1 or v2, ever
            outcomes = observer.stats()["outcomes"]["local"]
            assert outcomes.get("disconnected") == 2, outcomes  # the victim's two requests, ended when it left
            attacker.close()
            blocker.close()
    finally:
        ctx.destroy(linger=0)  # closes whatever a failed assertion left open
        assert d.stop() == 0
