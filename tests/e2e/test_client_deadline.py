"""A stream's ``timeout`` through real ZeroMQ sockets: the deadline is one timer a request whose expiry
reaches the reader after what already arrived. The peer is a scripted ZeroMQ ROUTER standing in for
the daemon (named as such: it answers exactly what each test needs, when it needs it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq

from clients import AsyncClient
from clients.events import EndEvent, TokenEvent
from clients.messages import batch_message, empty_timings, end_message, token_message
from clients.protocol import FinishReason, pack, unpack


class ScriptedPeer:
    """A ROUTER that answers each submit with ``tokens`` token messages (one frame), then an end
    unless ``end`` is false, the n-th submit after ``delays[n]`` seconds; it records every message
    it receives."""

    def __init__(self, address: str, tokens: int, end: bool, delays: tuple[float, ...] = ()) -> None:
        self.received: list[dict[str, Any]] = []
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._tokens, self._end, self._delays, self._stop = tokens, end, list(delays), threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            peer, frame = self._sock.recv_multipart()
            msg = unpack(frame)
            self.received.append(msg)
            if msg.get("type") != "submit":
                continue
            rid = msg["id"]
            if self._delays:
                time.sleep(self._delays.pop(0))
            events = [token_message(rid, [7 + i], f"t{i}", None) for i in range(self._tokens)]
            if self._end:
                usage = {"prompt_tokens": 1, "completion_tokens": self._tokens}
                events.append(end_message(rid, FinishReason.LENGTH, usage, empty_timings()))
            self._sock.send_multipart([peer, pack(batch_message(events))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


@pytest.fixture
def peer_address(tmp_path: Path) -> Iterator[str]:
    folder = tmp_path / "peer"
    folder.mkdir(mode=0o700)
    yield f"ipc://{folder / 'd.sock'}"


def test_a_deadline_mid_stream_comes_after_the_tokens_that_arrived_and_cancels(peer_address: str) -> None:
    peer = ScriptedPeer(peer_address, tokens=2, end=False)
    events: list[Any] = []

    async def main() -> None:
        async with AsyncClient(peer_address) as client:
            with pytest.raises(TimeoutError, match=r"did not end within 0\.5 s"):
                async for event in client.stream(tokens=[1], max_tokens=9, timeout=0.5, request_id="r1"):
                    events.append(event)

    try:
        anyio.run(main)
    finally:
        peer.close()
    assert [e.tokens for e in events if isinstance(e, TokenEvent)] == [[7], [8]]
    assert {"type": "cancel", "id": "r1"}.items() <= next(m for m in peer.received if m["type"] == "cancel").items()


def test_an_ended_request_s_deadline_never_reaches_a_later_request(peer_address: str) -> None:
    """The timer is cancelled when its request ends: a later request under the same id, answered
    after the first one's deadline has passed, is not timed out by it."""
    peer = ScriptedPeer(peer_address, tokens=1, end=True, delays=(0.0, 0.8))
    ends: list[EndEvent] = []

    async def main() -> None:
        async with AsyncClient(peer_address) as client:
            async for event in client.stream(tokens=[1], max_tokens=1, timeout=0.3, request_id="same"):
                if isinstance(event, EndEvent):
                    ends.append(event)
            with anyio.fail_after(10):
                async for event in client.stream(tokens=[1], max_tokens=1, request_id="same"):
                    if isinstance(event, EndEvent):
                        ends.append(event)

    try:
        anyio.run(main)
    finally:
        peer.close()
    assert [e.finish_reason for e in ends] == [FinishReason.LENGTH, FinishReason.LENGTH]
