"""The front end's transport with in-process connections, without a daemon: the outbox and pausing
of a slow reader, one frame per step for batching connections, a closed reader reported gone."""

from __future__ import annotations

import anyio
import pytest

from clients.protocol import MsgType
from scheduler.transport import Transport


def test_a_slow_local_reader_fills_its_outbox_pauses_and_resumes_in_order() -> None:
    gone: list[tuple[bytes, str]] = []
    pauses: list[tuple[bytes, bool]] = []
    transport = Transport(
        "ipc:///unused",
        max_frame_bytes=1 << 20,
        max_unsent_per_client=2,
        on_gone=lambda c, why: gone.append((c, why)),
        on_pause=lambda c, p: pauses.append((c, p)),
    )
    events = transport.open_local(b"\x00L")
    for i in range(5):
        transport.send(b"\x00L", {"n": i})
    assert pauses == [(b"\x00L", True)] and transport.is_paused(b"\x00L")
    assert transport.unsent == 3 and transport.outbox_full(b"\x00L")
    assert [events.receive_nowait()["n"] for _ in range(2)] == [0, 1]
    transport.flush_outboxes()
    assert [events.receive_nowait()["n"] for _ in range(2)] == [2, 3]
    transport.flush_outboxes()
    assert events.receive_nowait()["n"] == 4
    transport.flush_outboxes()
    assert pauses[-1] == (b"\x00L", False) and transport.unsent == 0 and not transport.is_paused(b"\x00L")
    assert gone == []


def test_batching_connections_get_one_frame_per_step() -> None:
    transport = Transport(
        "ipc:///unused", max_frame_bytes=1 << 20, max_unsent_per_client=8, on_gone=print, on_pause=print
    )
    events = transport.open_local(b"\x00B")
    transport.mark_batching(b"\x00B")
    transport.begin_step()
    transport.send(b"\x00B", {"n": 1})
    transport.send(b"\x00B", {"n": 2})
    with pytest.raises(anyio.WouldBlock):
        events.receive_nowait()  # nothing before the step ends
    transport.end_step()
    frame = events.receive_nowait()
    assert frame["type"] == MsgType.BATCH.value and [e["n"] for e in frame["events"]] == [1, 2]


def test_a_closed_local_reader_is_reported_gone_and_forgotten() -> None:
    gone: list[bytes] = []
    transport = Transport(
        "ipc:///unused",
        max_frame_bytes=1 << 20,
        max_unsent_per_client=2,
        on_gone=lambda c, why: gone.append(c),
        on_pause=lambda c, p: None,
    )
    events = transport.open_local(b"\x00C")
    events.close()
    transport.send(b"\x00C", {"n": 0})
    assert gone == [b"\x00C"]
    transport.forget(b"\x00C")
    assert not transport.is_local(b"\x00C")
