"""Claims in the README and docs/*.md that no other test pins, each against a real daemon.

With the single tenant ``local``: `--max-queued` (docs/tenants.md, Backpressure), the
`shutting_down` health status during a drain (docs/protocol.md), a 4-bit model served greedy-exact
(README: any mlx-lm model directory). Over CURVE sockets on 127.0.0.1 (docs/tenants.md): `priority`
capped at the tenant's `priority_ceiling`, SIGHUP adding keys and ending a removed tenant's waiting
requests with `unauthorized`, and `token_rate` slowing a tenant.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from clients import Client, RequestError
from clients.protocol import PROTOCOL_VERSION, pack
from tests.conftest import start_daemon, wait_for_verdict
from tests.e2e.test_bad_input import Raw
from tests.e2e.test_tenants import RawCurve, creds, curve_daemon, write_tenants
from tests.reference import greedy_reference

#: Long enough to hold the one decode slot for as long as a test needs; always cancelled.
BLOCKER: dict[str, Any] = {"tokens": [5, 6, 7], "max_tokens": 4000}


def send(sock: Raw | RawCurve, **msg: Any) -> None:
    """One protocol map, as any client would send it (fields the client library may not have)."""
    sock.sock.send(pack({"v": PROTOCOL_VERSION, **msg}))


def ends(sock: Raw | RawCurve, count: int) -> Iterator[dict[str, Any]]:
    """The next ``count`` ``end`` messages on ``sock`` in arrival order, token messages skipped."""
    seen = 0
    while seen < count:
        msg = sock.recv()
        if msg["type"] == "end":
            seen += 1
            yield msg


def first_token(sock: Raw | RawCurve, rid: str) -> None:
    """Wait until ``rid`` streams: from then on it holds a decode slot."""
    msg = sock.recv()
    assert (msg["type"], msg["id"]) == ("token", rid), msg


def test_beyond_max_queued_a_submit_is_busy_at_once(tiny_model: Path, tmp_path: Path) -> None:
    """Beyond `--max-queued` waiting requests a submit ends at once with `busy` and a retry hint;
    the waiting ones are served once the slot frees."""
    d = start_daemon(tiny_model, tmp_path, "--max-batch", "1", "--max-queued", "2")
    raw = Raw(d.address)
    try:
        send(raw, type="submit", id="blocker", **BLOCKER)
        first_token(raw, "blocker")
        for rid in ("q1", "q2", "q3"):
            send(raw, type="submit", id=rid, tokens=[9], max_tokens=2)
        refused = next(ends(raw, 1))  # long before the blocker's thousands of tokens are done
        assert refused["id"] == "q3" and refused["error"]["code"] == "busy", refused
        assert refused["error"]["retry_after_s"] > 0 and "limit 2" in refused["error"]["message"]
        send(raw, type="cancel", id="blocker")
        rest = {m["id"]: m["finish_reason"] for m in ends(raw, 3)}
        assert rest == {"blocker": "cancelled", "q1": "length", "q2": "length"}
    finally:
        raw.close()
        assert d.stop() == 0


def test_health_says_shutting_down_during_a_drain(tiny_model: Path, tmp_path: Path) -> None:
    """After SIGTERM with `--drain-timeout`, `health` answers `shutting_down` while in-flight
    requests finish; the daemon exits 0 once they have."""
    d = start_daemon(tiny_model, tmp_path, "--drain-timeout", "60")
    raw = Raw(d.address)
    try:
        send(raw, type="submit", id="long", **BLOCKER)
        first_token(raw, "long")
        d.proc.send_signal(signal.SIGTERM)
        with Client(d.address, timeout=5) as c:
            deadline = time.monotonic() + 5  # the signal is handled asynchronously: poll for its effect
            while (status := c.health()["status"]) == "ready" and time.monotonic() < deadline:
                time.sleep(0.02)
        assert status == "shutting_down"
        send(raw, type="cancel", id="long")  # still in flight: the drain was waiting for it
        assert next(ends(raw, 1))["finish_reason"] == "cancelled"
        assert d.proc.wait(timeout=60) == 0, d.log()
    finally:
        raw.close()
        if d.proc.poll() is None:
            d.stop()


@pytest.fixture(scope="module")
def four_bit_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama's shape with 4-bit weights (group size 64), as mlx-lm's converter writes them."""
    from workers.models.synthetic import llama_config, write_model

    config = llama_config(hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, quant_bits=4)
    return write_model(tmp_path_factory.mktemp("models") / "tiny-llama-4bit", config, seed=7)


def test_a_4bit_model_through_the_daemon_is_greedy_exact(four_bit_model: Path, tmp_path: Path) -> None:
    """Alone (speculative bursts, quantized projections pinned for the verify) and batched, a 4-bit
    model's greedy tokens equal mlx-lm's `generate_step` for each prompt alone."""
    assert json.loads((four_bit_model / "config.json").read_text())["quantization"]["bits"] == 4
    d = start_daemon(  # a short context keeps the start-up probe's draws short
        four_bit_model, tmp_path, "--draft", "prompt-lookup", "-k", "3", "--context-length", "300"
    )
    try:
        with Client(d.address, timeout=120) as c:
            wait_for_verdict(c, timeout=60)
            prompt = [7, 7, 7, 7, 8, 8, 8, 8]
            assert c.generate(tokens=prompt, max_tokens=60).tokens == greedy_reference(four_bit_model, prompt, 60)[0]
            assert c.stats()["engine"]["bursts"]["rounds"] > 0
            prompts = [[5, 6, 7], [9, 10], [30, 31, 32, 33]]
            with ThreadPoolExecutor(len(prompts)) as pool:
                results = list(pool.map(lambda p: c.generate(tokens=p, max_tokens=40), prompts))
            for p, r in zip(prompts, results):
                assert r.tokens == greedy_reference(four_bit_model, p, 40)[0]
    finally:
        assert d.stop() == 0


# ---------------------------------------------------------------- tenants (CURVE over tcp)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Keypairs in the files `mlx-batchd keys new NAME` writes (pyzmq certificates)."""
    d = tmp_path_factory.mktemp("keys")
    for name in ("server", "alice", "bob", "carol"):
        zmq.auth.create_certificates(str(d), name)
    return d


def test_priority_orders_a_tenants_waiting_requests_up_to_its_ceiling(
    tiny_model: Path, tmp_path: Path, keys: Path
) -> None:
    """With one decode slot taken, four requests wait; they start by priority, higher first, where a
    priority above the ceiling (5) counts as the ceiling and ties go by arrival. FIFO would give
    p0 p3 p5 p1000, an uncapped priority p1000 p5 p3 p0."""
    d = curve_daemon(tiny_model, tmp_path, keys, {"alice": {"priority_ceiling": 5}}, "--max-batch", "1")
    alice = RawCurve(d.address, keys, "alice")
    try:
        send(alice, type="submit", id="blocker", **BLOCKER)
        first_token(alice, "blocker")
        for rid, priority in (("p0", 0), ("p3", 3), ("p5", 5), ("p1000", 1000)):
            send(alice, type="submit", id=rid, tokens=[9], max_tokens=2, priority=priority)
        send(alice, type="cancel", id="blocker")
        order = [m["id"] for m in ends(alice, 5)]  # one slot: they end in the order they started
        assert order == ["blocker", "p5", "p1000", "p3", "p0"]
    finally:
        alice.close()
        assert d.stop() == 0


def test_sighup_removing_a_tenant_ends_its_waiting_requests_unauthorized(
    tiny_model: Path, tmp_path: Path, keys: Path
) -> None:
    """Bob's three requests wait behind alice's; a reload without bob ends each of them at once with
    `unauthorized` (one `end` each), and alice's request runs on undisturbed."""
    d = curve_daemon(tiny_model, tmp_path, keys, {"alice": {}, "bob": {}}, "--max-batch", "1")
    alice, bob = RawCurve(d.address, keys, "alice"), RawCurve(d.address, keys, "bob")
    bob.sock.setsockopt(zmq.RCVTIMEO, 15_000)
    try:
        send(alice, type="submit", id="blocker", **BLOCKER)
        first_token(alice, "blocker")
        for i in range(3):
            send(bob, type="submit", id=f"w{i}", tokens=[9], max_tokens=2)
        send(bob, type="health", id="h")  # answered after the submits before it: all three are waiting
        assert bob.recv()["id"] == "h"
        write_tenants(tmp_path / "tenants.toml", keys, {"alice": {}})
        d.proc.send_signal(signal.SIGHUP)
        refused = list(ends(bob, 3))  # long before the blocker would free the slot
        assert sorted(m["id"] for m in refused) == ["w0", "w1", "w2"]
        assert all(m["finish_reason"] == "error" and m["error"]["code"] == "unauthorized" for m in refused)
        send(alice, type="cancel", id="blocker")
        assert next(ends(alice, 1))["finish_reason"] == "cancelled"  # alice was never disturbed
    finally:
        alice.close()
        bob.close()
        assert d.stop() == 0


def test_sighup_adds_a_new_tenants_key_without_a_restart(tiny_model: Path, tmp_path: Path, keys: Path) -> None:
    """A key the daemon refuses is accepted, on a new connection, once a reload adds its tenant."""
    d = curve_daemon(tiny_model, tmp_path, keys, {"alice": {}})
    try:
        with Client(d.address, **creds(keys, "carol")) as carol, pytest.raises(RequestError) as refused:
            carol.health(timeout=10.0)
        assert refused.value.code == "unauthorized"
        write_tenants(tmp_path / "tenants.toml", keys, {"alice": {}, "carol": {}})
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20  # the signal is handled asynchronously: retry until it was
        while True:
            try:
                with Client(d.address, timeout=10, **creds(keys, "carol")) as carol:
                    result = carol.generate(tokens=[5, 6, 7], max_tokens=10)
                break
            except (RequestError, TimeoutError):
                assert time.monotonic() < deadline, "carol's key was never accepted after SIGHUP"
        assert result.tokens == greedy_reference(tiny_model, [5, 6, 7], 10)[0]
    finally:
        assert d.stop() == 0


RATE = 100.0  # tokens per second
BURST = 50
PER_REQUEST = 4 + 21  # prompt + max_tokens


def test_token_rate_slows_a_tenant_to_its_rate(tiny_model: Path, tmp_path: Path, keys: Path) -> None:
    """12 requests of 25 tokens from a tenant allowed 100 tokens/s (bucket 50, one at a time): past
    the bucket (and the one request that may overdraw it) the 300 tokens take at least 2.25 s at
    that rate; unlimited they take about 0.5 s here. Bounds are generous (x0.8), and the tenant is
    slowed, never stopped."""
    spec = {"token_rate": RATE, "token_burst": BURST, "max_concurrent": 1}
    d = curve_daemon(tiny_model, tmp_path, keys, {"alice": spec})
    alice = RawCurve(d.address, keys, "alice")
    # At this rate an end is due every 0.25 s; a silence of 30 s is a stall, not a slow machine.
    alice.sock.setsockopt(zmq.RCVTIMEO, 30_000)
    n = 12
    done: list[dict[str, Any]] = []
    try:
        tic = time.monotonic()
        for i in range(n):
            send(alice, type="submit", id=f"r{i}", tokens=[5 + i] * 4, max_tokens=PER_REQUEST - 4)
        try:
            done.extend(ends(alice, n))
        except zmq.Again:
            pytest.fail(f"stalled after {len(done)} of {n} ends:\n{d.log()[-3000:]}")
        elapsed = time.monotonic() - tic
    finally:
        alice.close()
        assert d.stop() == 0
    assert all(m["finish_reason"] in ("length", "stop") for m in done), done
    served = sum(m["usage"]["prompt_tokens"] + m["usage"]["completion_tokens"] for m in done)
    assert served > 10 * PER_REQUEST  # the tiny model does not stop early on these prompts
    assert elapsed >= 0.8 * (served - BURST - PER_REQUEST) / RATE, (served, elapsed)
    assert elapsed < served / RATE + 30, (served, elapsed)
