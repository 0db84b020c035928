"""The front end's in-process connections (``FrontEnd.open_local``), which the HTTP door stands on:
one that stops reading gets the ZeroMQ path's back-pressure, and closing one is a disconnect.

The front end runs in this process on a real engine thread and the tiny model: the kernel and
uvicorn buffer far more than a test stream is long, so only here does a reader fill the stream.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from clients.protocol import Submit
from scheduler.frontend import FrontEnd, FrontEndSettings
from tests.reference import greedy_reference
from workers.api import EngineSettings, Signal
from workers.engine.loop import EngineThread
from workers.models.loading import load


async def _until(check: Callable[[], bool], timeout: float = 60.0) -> None:
    with anyio.fail_after(timeout):
        while not check():
            await anyio.sleep(0.02)


def _run(tiny_model: Path, tmp_path: Path, body: Callable[[FrontEnd], Awaitable[None]]) -> None:
    """Start a front end, wait until it is ready, run ``body``, stop it."""
    settings = FrontEndSettings(
        listen=f"ipc://{tmp_path / 's' / 'd.sock'}", handle_signals=False, max_unsent_per_client=5
    )

    def make_engine(emit: Callable[[list[Signal]], None]) -> EngineThread:
        return EngineThread(lambda: load(str(tiny_model)), emit, EngineSettings())

    front = FrontEnd(settings, make_engine)
    codes: list[int] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:

            async def serve() -> None:
                codes.append(await front.run())

            tg.start_soon(serve)
            await _until(lambda: front.status == "ready", 120)
            try:
                await body(front)
            finally:
                front.stop()

    anyio.run(main, backend="asyncio")
    assert codes == [0]


async def _read_to_end(events: Any) -> tuple[list[int], dict[str, Any]]:
    tokens: list[int] = []
    async for msg in events:
        if msg["type"] == "end":
            return tokens, msg
        assert msg["type"] == "token", msg
        tokens += msg["tokens"]
    raise AssertionError("the stream closed without an end")


def test_a_connection_that_stops_reading_is_paused_and_loses_nothing(tiny_model: Path, tmp_path: Path) -> None:
    max_tokens = 300

    async def body(front: FrontEnd) -> None:
        conn = front.open_local("local")
        conn.submit(Submit(id="a", tokens=[5, 6, 7], max_tokens=max_tokens))

        def paused() -> bool:
            s = front.stats()
            return bool(s["clients_paused"] == 1 and s["unsent_messages"] > 0 and s["engine"]["paused"] == 1)

        await _until(paused)  # its stream of 5 is full and the rest waits in its outbox
        tokens, end = await _read_to_end(conn.events)
        conn.close()
        assert end["finish_reason"] == "length" and "error" not in end
        assert tokens == greedy_reference(tiny_model, [5, 6, 7], max_tokens)[0]
        s = front.stats()
        assert s["clients_paused"] == 0 and s["unsent_messages"] == 0 and s["requests_in_flight"] == 0

    _run(tiny_model, tmp_path, body)


def test_closing_a_connection_is_a_disconnect_and_cancel_is_the_wire_cancel(tiny_model: Path, tmp_path: Path) -> None:
    async def body(front: FrontEnd) -> None:
        conn = front.open_local("local")
        conn.submit(Submit(id="a", tokens=[5, 6, 7], max_tokens=300))
        await _until(lambda: front.stats()["engine"]["paused"] == 1)  # mid-stream, and it stays so
        conn.close()
        await _until(lambda: front.stats()["outcomes"].get("local", {}).get("disconnected") == 1)
        await _until(lambda: front.stats()["engine"]["active_sequences"] == 0)
        assert front.stats()["requests_in_flight"] == 0 and front.stats()["clients_dropped"] == 1

        cancelled = front.open_local("local")
        cancelled.submit(Submit(id="c", tokens=[5, 6, 7], max_tokens=300))
        await _until(lambda: front.stats()["engine"]["paused"] == 1)
        cancelled.cancel("c")
        _, end = await _read_to_end(cancelled.events)
        assert end["finish_reason"] == "cancelled"
        cancelled.close()

        other = front.open_local("local")
        assert other.id != conn.id and other.id[:1] == b"\x00" and len(other.id) == 17
        other.submit(Submit(id="a", tokens=[5, 6, 7], max_tokens=4))  # the same id, a new connection
        tokens, end = await _read_to_end(other.events)
        assert end["finish_reason"] == "length" and tokens == greedy_reference(tiny_model, [5, 6, 7], 4)[0]
        other.close()

        gone = front.open_local("nobody")
        gone.submit(Submit(id="b", tokens=[5], max_tokens=2))
        _, end = await _read_to_end(gone.events)
        assert end["error"]["code"] == "unauthorized"
        gone.close()

    _run(tiny_model, tmp_path, body)
