"""Fairness at every queue of the front end: a stalled reader's slots go to others (parked) and come back
when it reads; a tenant below its share of a full queue gets in; tokenizing takes tenants in turns."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

from clients.protocol import ErrorCode, FinishReason, Submit
from scheduler.tenants import DEFAULT_TENANT_MAX_QUEUED, load_tenants
from scheduler.tokenizing import FairTokenizer
from tests.helpers.frontend import Parts


def _two_tenants(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[tenants.a]\napi_keys_sha256 = ["{"a" * 64}"]\n{extra}\n[tenants.b]\napi_keys_sha256 = ["{"b" * 64}"]\n'
    )
    return path


def test_a_stalled_reader_is_parked_after_the_delay_and_gets_a_slot_back_when_it_reads() -> None:
    p = Parts(capacity=1, park_after_s=5.0, park_timeout_s=60.0)
    p.connect(b"\x00A")
    p.connect(b"\x00B")
    stalled = p.submit(b"\x00A", "local", "s", max_tokens=50)
    other = p.submit(b"\x00B", "local", "o")
    assert p.engine.submitted() == [stalled.seq] and not other.in_engine
    p.control.set_paused(b"\x00A", True)
    assert ("pause", stalled.seq) in p.engine.calls
    p.control.park_stalled(p.control._stalled_since[b"\x00A"] + 4.9)
    assert p.engine.submitted() == [stalled.seq]  # not yet: the delay has not passed
    p.control.park_stalled(p.control._stalled_since[b"\x00A"] + 5.0)
    assert stalled.parked and p.engine.submitted() == [stalled.seq, other.seq] and p.flight.parked == 1
    assert p.flight.kv_reserved == p.flight.kv_need(stalled) + p.flight.kv_need(
        other
    )  # the parked sequence keeps its KV
    p.control.set_paused(b"\x00A", False)  # it reads again, but the slot is taken
    assert stalled.parked and ("resume", stalled.seq) not in p.engine.calls
    p.flight.release(other.seq)
    assert not stalled.parked and ("resume", stalled.seq) in p.engine.calls and p.flight.in_engine == 1


def test_a_parked_sequence_resumes_before_any_waiting_request() -> None:
    p = Parts(capacity=1, park_after_s=1.0)
    p.connect(b"\x00A")
    p.connect(b"\x00B")
    stalled = p.submit(b"\x00A", "local", "s")
    first, second = p.submit(b"\x00B", "local", "1"), p.submit(b"\x00B", "local", "2")
    p.control.set_paused(b"\x00A", True)
    p.control.park_stalled(p.control._stalled_since[b"\x00A"] + 1.0)
    assert first.in_engine and not second.in_engine
    p.control.set_paused(b"\x00A", False)
    p.flight.release(first.seq)
    assert not stalled.parked and not second.in_engine  # the woken sequence took the free slot
    p.flight.release(stalled.seq)
    assert second.in_engine and p.flight.in_engine == 1


def test_a_parked_sequence_that_ends_frees_no_slot_twice() -> None:
    p = Parts(capacity=1, park_after_s=1.0)
    p.connect(b"\x00A")
    p.connect(b"\x00B")
    stalled = p.submit(b"\x00A", "local", "s")
    other = p.submit(b"\x00B", "local", "o")
    p.control.set_paused(b"\x00A", True)
    p.control.park_stalled(p.control._stalled_since[b"\x00A"] + 1.0)
    assert p.flight.release(stalled.seq) is stalled
    assert p.flight.in_engine == 1 and other.in_engine


def test_a_reader_stalled_past_the_timeout_has_its_requests_ended_disconnected() -> None:
    p = Parts(capacity=2, park_after_s=1.0, park_timeout_s=10.0)
    p.connect(b"\x00A")
    running, waiting = p.submit(b"\x00A", "local", "r"), p.submit(b"\x00A", "local", "w")
    p.submit(b"\x00A", "local", "x")  # a third, queued behind the two slots
    p.control.set_paused(b"\x00A", True)
    p.control.park_stalled(p.control._stalled_since[b"\x00A"] + 10.0)
    cancels = [c for c in p.engine.calls if c[0] == "cancel"]
    assert ("cancel", running.seq, "error", ErrorCode.DISCONNECTED.value) in cancels
    assert ("cancel", waiting.seq, "error", ErrorCode.DISCONNECTED.value) in cancels
    [end] = p.received(b"\x00A")  # the one still waiting ends here (into its outbox)
    assert end["id"] == "x" and end["error"]["code"] == ErrorCode.DISCONNECTED.value
    p.control.park_stalled(p.control._stalled_since[b"\x00A"] + 1.0)  # nothing is ended twice
    assert [c for c in p.engine.calls if c[0] == "cancel"] == cancels


def test_a_full_queue_makes_room_for_a_tenant_below_its_share(tmp_path: Path) -> None:
    """Tenant a fills the daemon's queue; b's request takes the place of a's newest one, which ends
    ``busy``; a's next request is refused, since a holds the most."""
    p = Parts(load_tenants(_two_tenants(tmp_path, "max_queued = 100")), capacity=1, max_queued=4)
    p.connect(b"\x00A")
    p.connect(b"\x00B")
    a = [p.submit(b"\x00A", "a", str(i)) for i in range(5)]  # one runs, four wait: the queue is full
    assert a[0].in_engine and p.flight.requests.waiting() == 4
    b = p.submit(b"\x00B", "b", "b1")
    [evicted] = p.received(b"\x00A")
    assert evicted["id"] == "4" and evicted["error"]["code"] == ErrorCode.BUSY.value
    assert p.flight.requests.holds(b) and p.flight.requests.waiting("b") == 1
    p.intake.submit(b"\x00A", p.flight.table.tenants["a"], Submit("5", tokens=[1], max_tokens=1))
    [refused] = p.received(b"\x00A")
    assert refused["id"] == "5" and refused["error"]["code"] == ErrorCode.BUSY.value
    p.flight.release(a[0].seq)
    p.flight.release(a[1].seq)
    assert b.in_engine or a[2].in_engine  # served in fair turns from here


def test_a_tenant_without_max_queued_gets_the_default_share(tmp_path: Path) -> None:
    table = load_tenants(_two_tenants(tmp_path))
    assert table.tenants["a"].max_queued == DEFAULT_TENANT_MAX_QUEUED < 1024
    p = Parts(table, capacity=1, max_inflight_per_client=10_000)
    p.connect(b"\x00A")
    for i in range(DEFAULT_TENANT_MAX_QUEUED + 1):
        p.submit(b"\x00A", "a", str(i))
    assert p.received(b"\x00A") == []
    p.intake.submit(b"\x00A", table.tenants["a"], Submit("over", tokens=[1], max_tokens=1))
    [busy] = p.received(b"\x00A")
    assert busy["id"] == "over" and busy["error"]["code"] == ErrorCode.BUSY.value
    assert busy["finish_reason"] == FinishReason.ERROR.value


async def _tokenize_turns(workers: int) -> list[str]:
    """Tenant a sends 24 prompts whose tokenizing blocks until released; then b sends one. The
    order in which calls finish, with a released only once b is done."""
    tok = FairTokenizer(workers)
    gate = threading.Event()
    done: list[str] = []
    b_done = anyio.Event()

    async def one(tenant: str, i: int) -> None:
        await tok.run(tenant, gate.wait if tenant == "a" else (lambda: None))
        done.append(f"{tenant}{i}")
        if tenant == "b":
            b_done.set()

    async with anyio.create_task_group() as tg:
        for i in range(24):
            tg.start_soon(one, "a", i)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(one, "b", 0)
        with anyio.fail_after(30):
            await b_done.wait()
        assert tok.running("a") == workers - 1 and tok.waiting == 24 - (workers - 1)
        gate.set()
    return done


@pytest.mark.parametrize("workers", [2, 4])
def test_one_tenants_prompts_do_not_hold_back_anothers_tokenizing(workers: int) -> None:
    done = anyio.run(_tokenize_turns, workers)
    assert done[0] == "b0" and len(done) == 25


def test_tokenizing_runs_in_parallel_for_one_tenant() -> None:
    async def main() -> int:
        tok = FairTokenizer(3)
        gate = threading.Event()
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(tok.run, "a", gate.wait)
            await anyio.wait_all_tasks_blocked()
            running = tok.running("a")
            gate.set()
        return running

    assert anyio.run(main) == 2  # all workers but the one kept for other tenants


def test_a_cancelled_wait_leaves_the_tokenizing_queue() -> None:
    async def main() -> tuple[int, int]:
        tok = FairTokenizer(1)
        gate = threading.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(tok.run, "a", gate.wait)
            await anyio.wait_all_tasks_blocked()
            with anyio.move_on_after(0.01):
                await tok.run("b", lambda: None)
            waiting = tok.waiting
            gate.set()
        return waiting, tok.running("a")

    assert anyio.run(main) == (0, 0)


def test_requests_that_arrive_while_the_model_loads_count_against_the_limits_and_start_when_ready() -> None:
    p = Parts(capacity=4, max_queued=2)
    info, p.flight.info = p.flight.info, None  # still loading
    p.connect(b"\x00A")
    first, second = p.submit(b"\x00A", "local", "1"), p.submit(b"\x00A", "local", "2")
    p.intake.submit(b"\x00A", p.flight.table.tenants["local"], Submit("3", tokens=[1], max_tokens=1))
    [busy] = p.received(b"\x00A")
    assert busy["id"] == "3" and busy["error"]["code"] == ErrorCode.BUSY.value
    p.control.cancel("local", b"\x00A", "2")
    assert p.engine.submitted() == []
    p.flight.info = info
    p.intake.on_ready()
    assert p.engine.submitted() == [first.seq]
    [cancelled] = p.received(b"\x00A")
    assert cancelled["id"] == "2" and cancelled["finish_reason"] == FinishReason.CANCELLED.value
    assert not p.flight.requests.holds(second)
