"""One frame per connection per engine step: a connection that reads ``batch`` messages gets a
step's events for all its requests in one frame, in order; one that never said so gets one event
per frame. Real daemon, real ZeroMQ sockets, the tiny random model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from clients import Client
from clients.messages import unbatch
from clients.protocol import PROTOCOL_VERSION, pack, unpack
from tests.conftest import TEST_CONTEXT, Daemon, start_daemon
from tests.reference import greedy_reference

REQUESTS = 6
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def busy_daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tiny_model, tmp_path_factory.mktemp("coalesce"), "--context-length", str(TEST_CONTEXT))
    yield d
    assert d.stop() == 0, d.log()


def _run(address: str, batch: bool) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Submit ``REQUESTS`` greedy requests on one raw connection; return every frame received
    (decoded) and the events per request id, in arrival order."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.connect(address)
    frames: list[dict[str, Any]] = []
    events: dict[str, list[dict[str, Any]]] = {f"r{i}": [] for i in range(REQUESTS)}
    try:
        for i in range(REQUESTS):
            msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": "submit", "id": f"r{i}"}
            msg.update(tokens=[5 + i, 9, 11], max_tokens=MAX_TOKENS)
            if batch:
                msg["batch"] = True
            sock.send(pack(msg))
        ended = 0
        while ended < REQUESTS:
            frame = unpack(sock.recv(), 1 << 30)
            frames.append(frame)
            for ev in unbatch(frame):
                events[ev["id"]].append(ev)
                ended += ev["type"] == "end"
    finally:
        sock.close()
        ctx.term()
    return frames, events


def _check_streams(tiny_model: Path, events: dict[str, list[dict[str, Any]]]) -> None:
    """Every request's events: tokens in order, then exactly one end, greedy-exact."""
    for i in range(REQUESTS):
        evs = events[f"r{i}"]
        assert [e["type"] for e in evs].count("end") == 1 and evs[-1]["type"] == "end", evs
        assert evs[-1]["finish_reason"] == "length", evs[-1]
        tokens = [t for e in evs[:-1] for t in e["tokens"]]
        assert tokens == greedy_reference(tiny_model, [5 + i, 9, 11], MAX_TOKENS)[0]


def test_a_batching_connection_gets_one_frame_per_step(busy_daemon: Daemon, tiny_model: Path) -> None:
    frames, events = _run(busy_daemon.address, batch=True)
    batches = [f for f in frames if f["type"] == "batch"]
    assert batches, "no step's events were coalesced"
    # Concurrent requests share steps: some frame carries events of several requests.
    assert any(len({e["id"] for e in b["events"]}) > 1 for b in batches)
    total = sum(len(v) for v in events.values())
    assert len(frames) < total
    _check_streams(tiny_model, events)


def test_a_connection_that_never_asked_gets_one_event_per_frame(busy_daemon: Daemon, tiny_model: Path) -> None:
    frames, events = _run(busy_daemon.address, batch=False)
    assert all(f["type"] != "batch" for f in frames)
    assert len(frames) == sum(len(v) for v in events.values())
    _check_streams(tiny_model, events)


def test_the_client_library_reads_batches(busy_daemon: Daemon, tiny_model: Path) -> None:
    """The client asks for batches and unbatches them: concurrent streams stay exact and apart."""
    import concurrent.futures

    with Client(busy_daemon.address, timeout=120) as c:

        def one(i: int) -> list[int]:
            return c.generate(tokens=[5 + i, 9, 11], max_tokens=MAX_TOKENS).tokens

        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            got = list(pool.map(one, range(REQUESTS)))
    for i, tokens in enumerate(got):
        assert tokens == greedy_reference(tiny_model, [5 + i, 9, 11], MAX_TOKENS)[0]
