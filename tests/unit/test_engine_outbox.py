"""The engine process's outbox (``scheduler.engine_outbox``) over a real OS pipe: each batch of
events is one message, in the order handed over, with the engine's snapshot on the first batch and
on every batch with an end; a front end that stopped reading makes the engine wait."""

from __future__ import annotations

import io
import os
import threading
from typing import Any

import msgpack

from scheduler.engine_outbox import Outbox
from scheduler.event_pipe import PipeWriter
from workers.api import Finished, FinishReason, StepInfo, StepKind, Timings, TokenMode, Tokens, to_wire


class FakeEngine:
    """Stands in for ``EngineThread`` (its ``snapshot`` only): a counter of snapshots taken."""

    def __init__(self) -> None:
        self.taken = 0

    def snapshot(self) -> dict[str, Any]:
        self.taken += 1
        return {"n": self.taken}


def batches(n: int) -> list[list[Any]]:
    """``n`` decode steps of two sequences, the last ending one of them."""
    out: list[list[Any]] = []
    for i in range(n):
        step: list[Any] = [StepInfo(StepKind.DECODE, 0.001, 2)]
        step += [Tokens(seq, [100 + i], None, TokenMode.BATCHED) for seq in (1, 2)]
        if i == n - 1:
            step.append(Finished(2, FinishReason.LENGTH, 3, n, Timings(0.0, 0.0, 0.0, 0.0)))
        out.append(step)
    return out


def written(n: int) -> list[dict[str, Any]]:
    """Every message ``n`` batches make through an outbox, read back from the pipe."""
    r, w = os.pipe()
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(r, 1 << 16), b"")))
    reader.start()
    outbox = Outbox(PipeWriter(w), FakeEngine, to_wire)
    for b in batches(n):
        outbox.events(b)
    os.close(w)
    reader.join()
    os.close(r)
    return list(msgpack.Unpacker(io.BytesIO(b"".join(chunks)), raw=False))


def test_each_batch_is_one_message_in_order_with_snapshots_on_the_first_and_on_ends() -> None:
    msgs = written(50)
    assert len(msgs) == 50
    assert [m["events"] for m in msgs] == [to_wire(b) for b in batches(50)]
    assert "snapshot" in msgs[0] and "snapshot" in msgs[-1]  # the first, and the one with an end
    assert sum("snapshot" in m for m in msgs) <= 3  # not every step: at most every 0.1 s besides


def test_an_engine_waits_for_a_front_end_that_stopped_reading() -> None:
    """A full pipe makes ``events`` wait: the engine's lead is bounded, and nothing is lost or
    reordered once the reader reads again."""
    r, w = os.pipe()  # the default buffer (64 KiB on Linux): a few 10 KB messages fill it
    outbox = Outbox(PipeWriter(w), FakeEngine, lambda signals: [{"pad": "x" * 10_000, "i": signals[0]}])
    total = 100
    handed: list[int] = []

    def engine() -> None:
        for i in range(total):
            outbox.events([i])
            handed.append(i)

    t = threading.Thread(target=engine, daemon=True)
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive(), "the engine thread never waited for the reader"
    assert len(handed) < total
    unpacker = msgpack.Unpacker(raw=False)
    got: list[int] = []
    while len(got) < total:
        unpacker.feed(os.read(r, 1 << 16))
        got += [m["events"][0]["i"] for m in unpacker]
    t.join(timeout=10)
    os.close(w)
    os.close(r)
    assert got == list(range(total))
