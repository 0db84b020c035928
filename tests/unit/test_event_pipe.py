"""The engine process's event pipe: whole messages in order from concurrent writers, messages larger
than the pipe's buffer, the end of the stream once the writer closes, and a writer whose reader is
gone that says so instead of raising. Real OS pipes and threads."""

from __future__ import annotations

import os
import threading

from scheduler.event_pipe import PIPE_BYTES, PipeWriter, open_pipe, read_messages


def test_messages_from_two_writers_arrive_whole_and_in_order() -> None:
    r, w = open_pipe()
    writer = PipeWriter(w)
    big = "x" * (3 * PIPE_BYTES)  # larger than any pipe buffer: split across many reads

    def write(name: str) -> None:
        for i in range(200):
            assert writer.send({"from": name, "i": i, "pad": big if i % 50 == 7 else ""})

    # Daemon threads, bounded joins: a broken stream stops the reader and leaves the writers blocked.
    threads = [threading.Thread(target=write, args=(n,), daemon=True) for n in ("engine", "main")]
    got: list[dict[str, object]] = []
    reader = threading.Thread(target=lambda: got.extend(read_messages(r)), daemon=True)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), f"a writer is stuck after {len(got)} messages read: the stream broke"
    writer.close()
    reader.join(30)
    assert not reader.is_alive(), "the reader did not see the end of the stream"
    os.close(r)
    assert len(got) == 400
    for name in ("engine", "main"):
        mine = [m for m in got if m["from"] == name]
        assert [m["i"] for m in mine] == list(range(200))
        assert all(m["pad"] == (big if m["i"] % 50 == 7 else "") for m in mine)  # type: ignore[operator]


def test_a_writer_whose_reader_is_gone_says_so() -> None:
    r, w = open_pipe()
    writer = PipeWriter(w)
    assert writer.send({"t": "ready"})
    os.close(r)
    assert writer.send({"t": "tokens"}) is False  # EPIPE, not an exception (nor a SIGPIPE)
    assert writer.send({"t": "tokens"}) is False
    writer.close()


def test_the_stream_ends_when_the_last_write_end_closes() -> None:
    r, w = open_pipe()
    writer = PipeWriter(w)
    writer.send({"n": 1})
    writer.close()
    assert list(read_messages(r)) == [{"n": 1}]
    os.close(r)


def _receive_all(in_loop: bool, final_at: int | None) -> tuple[list[int], bool, list[str]]:
    """Writes 50 messages (and closes) after a gate thread ends; a Receiver started in an event loop
    or outside one hands them over. Returns what arrived, whether ``on_end`` ran, and on which
    threads the messages were handled."""
    import asyncio

    from scheduler.event_pipe import Receiver

    r, w = open_pipe()
    got: list[int] = []
    ended: list[bool] = []
    threads: list[str] = []

    def on_message(msg: dict[str, object]) -> bool:
        got.append(int(msg["i"]))  # type: ignore[call-overload]
        threads.append(threading.current_thread().name)
        return msg["i"] == final_at

    receiver = Receiver(r, on_message, lambda: ended.append(True), "test-events")
    gate = threading.Thread(target=lambda: None)

    def write() -> None:
        writer = PipeWriter(w)
        for i in range(50):
            writer.send({"i": i, "pad": "y" * (i * 997)})
        writer.close()

    writer = threading.Thread(target=write, daemon=True)  # the pipe holds less than all 50

    async def in_a_loop() -> None:
        receiver.start(after=gate)
        writer.start()
        for _ in range(3000):
            if receiver.done.is_set():
                return
            await asyncio.sleep(0.01)

    gate.start()
    if in_loop:
        asyncio.run(in_a_loop())
    else:
        receiver.start(after=gate)
        writer.start()
    assert receiver.done.wait(30)
    os.close(r)
    return got, bool(ended), threads


def test_a_receiver_in_an_event_loop_reads_there_and_sees_the_end() -> None:
    got, ended, threads = _receive_all(in_loop=True, final_at=None)
    assert got == list(range(50)) and ended
    assert set(threads) == {"MainThread"}  # the loop's thread, no reader thread


def test_a_receiver_outside_a_loop_reads_on_its_thread_and_stops_at_the_final_message() -> None:
    got, ended, threads = _receive_all(in_loop=False, final_at=20)
    assert got == list(range(21)) and not ended
    assert set(threads) == {"test-events"}
    got, ended, _ = _receive_all(in_loop=True, final_at=20)
    assert got == list(range(21)) and not ended
