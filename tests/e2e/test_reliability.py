"""A client that dies mid-stream loses its requests, and nobody else notices."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq

from clients import Client, EndEvent, RequestError
from clients.protocol import PROTOCOL_VERSION, pack, unpack
from tests.conftest import Daemon, start_daemon
from tests.reference import greedy_reference

STREAMER = """
import sys
from clients import Client, TokenEvent
with Client(sys.argv[1]) as c:
    for ev in c.stream(tokens=[5, 6, 7], max_tokens=4000):
        if isinstance(ev, TokenEvent):
            print("streaming", flush=True)
"""


def test_kill_9_of_a_client_mid_stream_frees_its_slot(tiny_model: Path, tmp_path: Path) -> None:
    daemon = start_daemon(tiny_model, tmp_path)
    try:
        _kill_a_streaming_client(daemon, tiny_model)
    finally:
        assert daemon.stop() == 0


def _kill_a_streaming_client(daemon: Daemon, tiny_model: Path) -> None:
    victim = subprocess.Popen([sys.executable, "-c", STREAMER, daemon.address], stdout=subprocess.PIPE, text=True)
    assert victim.stdout is not None and victim.stdout.readline().strip() == "streaming"
    with Client(daemon.address, timeout=120) as c:
        assert c.stats()["requests_in_flight"] >= 1
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        deadline = time.monotonic() + 30
        while c.stats()["requests_in_flight"] or c.stats()["engine"]["active_sequences"]:
            assert time.monotonic() < deadline, c.stats()
            time.sleep(0.05)
        # It ended because its client vanished, long before its 4000 tokens.
        assert c.stats()["engine"]["generated_tokens"] < 3000
        # The daemon carries on, exact as ever.
        assert c.generate(tokens=[9, 9], max_tokens=12).tokens == greedy_reference(tiny_model, [9, 9], 12)[0]


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def test_a_request_failing_in_the_engine_ends_alone(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected at the named test seam (workers.engine.faults): any sequence whose prompt holds token 257
    fails while the engine processes its share of a batched step."""
    monkeypatch.setenv("MLX_BATCHD_TEST_FAULTS", "request_token=257")
    d = start_daemon(tiny_model, tmp_path)
    try:
        prompts = [[5, 6, 7], [9, 257, 10], [30, 31], [40]]
        with Client(d.address, timeout=120) as c, ThreadPoolExecutor(4) as pool:
            outcomes = list(pool.map(lambda p: _outcome(c, p), prompts))
        assert isinstance(outcomes[1], RequestError) and outcomes[1].code == "engine_error"
        for p, r in zip(prompts, outcomes):
            if p != prompts[1]:
                assert r.tokens == greedy_reference(tiny_model, p, 30)[0]
    finally:
        assert d.stop() == 0


def _outcome(c: Client, prompt: list[int]) -> Any:
    try:
        return c.generate(tokens=prompt, max_tokens=30)
    except RequestError as exc:
        return exc


def test_engine_death_tells_every_client_and_exits_nonzero(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected at the named test seam: the engine loop itself raises after 150 iterations."""
    monkeypatch.setenv("MLX_BATCHD_TEST_FAULTS", "engine_loop_after=150")
    d = start_daemon(tiny_model, tmp_path)
    with Client(d.address, timeout=120) as c:
        with pytest.raises(RequestError) as info:
            c.generate(tokens=[5, 6, 7], max_tokens=4000)
    assert info.value.code == "engine_dead"
    assert d.proc.wait(timeout=60) != 0
    assert "injected engine loop failure" in d.log()


def test_kv_budget_refuses_what_can_never_fit_and_queues_the_rest(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path, "--kv-budget-mb", "0.05")  # about 100 tokens of this model's KV
    try:
        with Client(d.address, timeout=120) as c:
            with pytest.raises(RequestError) as info:
                c.generate(tokens=[5, 6, 7], max_tokens=200)
            assert info.value.code == "kv_budget" and "MiB" in info.value.message
            prompts = [[5, 6, 7], [8, 9, 10]]
            with ThreadPoolExecutor(2) as pool:  # 2 x 63 tokens > budget: the second waits its turn
                results = list(pool.map(lambda p: c.generate(tokens=p, max_tokens=60), prompts))
            for p, r in zip(prompts, results):
                assert r.tokens == greedy_reference(tiny_model, p, 60)[0]
            assert (
                max(r.timings["queue_s"] or 0 for r in results) > min(r.timings["total_s"] or 0 for r in results) * 0.5
            )
            stats = c.stats()
            assert stats["kv_reserved_bytes"] == 0 and stats["engine"]["peak_batch_size"] == 1
    finally:
        assert d.stop() == 0


def test_soak_random_cancels_and_disconnects(tiny_model: Path, tmp_path: Path) -> None:
    """Bounded soak on loopback: 6 clients x 30 requests, random prompts, ~20 % cancelled mid-stream,
    ~10 % abandoned by closing the connection mid-stream. Every request a live client waited for
    gets exactly one terminal event; afterwards nothing is in flight and memory has not grown."""
    d = start_daemon(tiny_model, tmp_path, "--max-batch", "8")
    ends: list[str] = []
    #: What went wrong on the client threads; asserted empty on the main thread (an assert on a
    #: thread would only be a warning).
    failures: list[str] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        client = Client(d.address, timeout=120)
        try:
            for n in range(30):
                prompt = [rng.randrange(4, 260) for _ in range(rng.randrange(1, 30))]
                fate = rng.random()
                terminal = streamed = 0
                for i, event in enumerate(client.stream(tokens=prompt, max_tokens=rng.randrange(1, 40))):
                    if isinstance(event, EndEvent):
                        terminal += 1
                        with lock:
                            ends.append(event.finish_reason)
                            if event.usage["completion_tokens"] != streamed:
                                failures.append(f"client {seed}, request {n}: {streamed} tokens streamed, {event}")
                            if fate >= 0.2 and event.finish_reason not in ("stop", "length"):
                                failures.append(f"client {seed}, request {n}: never cancelled, yet {event}")
                        continue
                    streamed += len(event.tokens)
                    if fate < 0.2 and i == 2:
                        client.cancel(event.request_id)
                    elif fate > 0.9 and i == 1:
                        client.close()  # abrupt: no cancel, the socket just goes away
                        client = Client(d.address, timeout=120)
                        break
                else:
                    if terminal != 1:
                        with lock:
                            failures.append(f"client {seed}, request {n}: {terminal} terminal events, not 1")
        finally:
            client.close()

    def checked(seed: int) -> None:
        try:
            worker(seed)
        except BaseException as exc:
            with lock:
                failures.append(f"client {seed}: {exc!r}")

    try:
        with Client(d.address, timeout=60) as c:
            threads = [threading.Thread(target=checked, args=(s,)) for s in range(6)]
            rss_before = _rss_kb(d.proc.pid)
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=240)
                assert not t.is_alive()
            assert not failures, failures
            deadline = time.monotonic() + 30
            while c.stats()["requests_in_flight"] or c.stats()["engine"]["active_sequences"]:
                assert time.monotonic() < deadline, c.stats()
                time.sleep(0.05)
            rss_after = _rss_kb(d.proc.pid)
        assert len(ends) > 100 and "cancelled" in ends
        assert set(ends) <= {"stop", "length", "cancelled"}
        assert rss_after < rss_before * 1.5 + 64 * 1024, (rss_before, rss_after)
    finally:
        assert d.stop() == 0


def test_in_flight_cap_per_connection(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path, "--max-inflight-per-client", "2", "--max-batch", "1")
    try:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.RCVTIMEO, 30_000)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(d.address)
        for i in range(4):
            raw.send(pack({"v": PROTOCOL_VERSION, "type": "submit", "id": f"r{i}", "tokens": [5, 6], "max_tokens": 50}))
        ends: dict[str, dict[str, Any]] = {}
        while len(ends) < 4:
            msg = unpack(raw.recv(), 1 << 30)
            if msg["type"] == "end":
                ends[msg["id"]] = msg
        raw.close()
        busy = [m for m in ends.values() if m.get("error", {}).get("code") == "busy"]
        assert len(busy) == 2 and all(m["error"]["retry_after_s"] > 0 for m in busy)
        assert {m["finish_reason"] for i, m in ends.items() if m not in busy} <= {"length", "stop"}
        with Client(d.address, timeout=60) as c:  # another connection is not affected
            assert c.generate(tokens=[5], max_tokens=3).finish_reason in ("length", "stop")
    finally:
        assert d.stop() == 0
