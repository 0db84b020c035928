"""The coordinator's parts (flight, control, intake, engine events, local connections) wired as
``FrontEnd`` wires them around an engine that only records: slots and the KV budget, the submit
limits, cancel, disconnect, pausing, tenant reload, engine events and in-process connections."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from clients.protocol import ErrorCode, FinishReason, MsgType, Stats, Submit
from scheduler.engine_events import EngineEvents
from scheduler.local import LocalConnection
from scheduler.requests import Tracked
from scheduler.settings import ConfigError, FrontEndSettings, load_table
from scheduler.tenants import load_tenants
from tests.helpers.frontend import INFO, Parts, Tokenizer, _finished
from workers.api import Dead, Ready, Stopped, Tokens


def test_waiting_requests_fill_the_free_slots_and_a_finish_starts_the_next() -> None:
    p = Parts(capacity=2)
    p.connect(b"\x00A")
    a, b, c = (p.submit(b"\x00A", "local", rid) for rid in ("a", "b", "c"))
    assert p.engine.submitted() == [a.seq, b.seq] and a.in_engine and not c.in_engine
    assert p.flight.in_engine == 2 and p.flight.kv_reserved == 2 * (3 + 2) * INFO.kv_bytes_per_token
    assert p.flight.release(a.seq) is a and not p.flight.requests.holds(a)
    assert p.engine.submitted() == [a.seq, b.seq, c.seq] and p.flight.in_engine == 2
    assert p.flight.release(a.seq) is None  # the engine ends a sequence once
    assert p.received(b"\x00A") == []


def test_the_kv_budget_holds_back_what_does_not_fit_now_and_refuses_what_never_fits() -> None:
    need = (3 + 2) * INFO.kv_bytes_per_token
    p = Parts(kv_budget_bytes=2 * need)
    p.connect(b"\x00A")
    first, second, third = (p.submit(b"\x00A", "local", rid) for rid in ("1", "2", "3"))
    assert p.engine.submitted() == [first.seq, second.seq] and p.flight.kv_reserved == 2 * need
    p.flight.release(first.seq)
    assert p.engine.submitted()[-1] == third.seq
    p.intake.submit(b"\x00A", p.flight.table.tenants["local"], Submit("big", tokens=[1, 2, 3], max_tokens=50))
    [end] = p.received(b"\x00A")
    assert end["id"] == "big" and end["error"]["code"] == ErrorCode.KV_BUDGET.value
    assert ("local", b"\x00A", "big") not in p.flight.requests


def test_the_prefix_cache_bound_is_carved_out_of_the_kv_budget() -> None:
    """With a prefix cache, requests get the budget less the cache's bound; a bound that leaves them
    nothing does not start."""
    need = (3 + 2) * INFO.kv_bytes_per_token
    p = Parts(kv_budget_bytes=3 * need, prefix_cache_bytes=need)
    p.connect(b"\x00A")
    first, second, third = (p.submit(b"\x00A", "local", rid) for rid in ("1", "2", "3"))
    assert p.engine.submitted() == [first.seq, second.seq] and not third.in_engine
    p.intake.submit(b"\x00A", p.flight.table.tenants["local"], Submit("big", tokens=[1, 2, 3], max_tokens=8))
    [end] = p.received(b"\x00A")
    assert end["error"]["code"] == ErrorCode.KV_BUDGET.value and "prefix cache" in end["error"]["message"]
    with pytest.raises(ConfigError, match="counted in the KV budget"):
        load_table(FrontEndSettings("ipc:///unused", kv_budget_bytes=need, prefix_cache_bytes=need))


def test_limits_refuse_a_duplicate_id_a_full_connection_and_a_closing_daemon() -> None:
    p = Parts(capacity=1, max_inflight_per_client=2)
    p.connect(b"\x00A")
    p.submit(b"\x00A", "local", "1")
    p.submit(b"\x00A", "local", "1")
    [dup] = p.received(b"\x00A")
    assert dup["type"] == MsgType.ERROR.value and dup["code"] == ErrorCode.DUPLICATE_REQUEST_ID.value
    p.submit(b"\x00A", "local", "2")
    p.intake.submit(b"\x00A", p.flight.table.tenants["local"], Submit("3", tokens=[1], max_tokens=1))
    [busy] = p.received(b"\x00A")
    assert busy["id"] == "3" and busy["error"]["code"] == ErrorCode.BUSY.value and busy["error"]["retry_after_s"] == 1.0
    p.flight.closing = True  # said before any limit: the connection is still full
    p.intake.submit(b"\x00A", p.flight.table.tenants["local"], Submit("4", tokens=[1], max_tokens=1))
    [closing] = p.received(b"\x00A")
    assert closing["id"] == "4" and closing["error"]["code"] == ErrorCode.SHUTDOWN.value
    assert p.counters.refused == 1 and len(p.flight.requests) == 2


def test_a_cancel_ends_a_request_wherever_it_is() -> None:
    p = Parts(capacity=1)
    p.connect(b"\x00A")
    running, waiting = p.submit(b"\x00A", "local", "run"), p.submit(b"\x00A", "local", "wait")
    tokenizing = Tracked(b"\x00A", "local", "tok", p.flight.requests.next_seq(), 0.0, Submit("tok", "p"))
    p.flight.requests.add(tokenizing)
    local = p.flight.table.tenants["local"]
    for rid in ("run", "wait", "tok", "nobody"):
        p.intake.cancel(local, b"\x00A", rid)
    assert ("cancel", running.seq, "cancelled", None) in p.engine.calls
    ended, unknown = p.received(b"\x00A")
    assert ended["id"] == "wait" and ended["finish_reason"] == FinishReason.CANCELLED.value
    assert unknown["type"] == MsgType.ERROR.value and unknown["code"] == ErrorCode.UNKNOWN_REQUEST_ID.value
    assert tokenizing.cancel_requested and p.flight.requests.holds(tokenizing) and not p.flight.requests.holds(waiting)


def test_a_gone_connection_ends_its_requests_without_sending_them_anything() -> None:
    p = Parts(capacity=1)
    p.connect(b"\x00A")
    p.connect(b"\x00B")
    running, _ = p.submit(b"\x00A", "local", "1"), p.submit(b"\x00A", "local", "2")
    other = p.submit(b"\x00B", "local", "1")
    p.control.drop_client(b"\x00A", "test")
    assert ("cancel", running.seq, "error", ErrorCode.DISCONNECTED.value) in p.engine.calls
    assert p.received(b"\x00A") == [] and not p.transport.is_local(b"\x00A")
    assert p.counters.clients_dropped == 1 and p.flight.outputs.outcomes == {"local": {"disconnected": 1}}
    assert list(p.flight.requests) == [other]
    p.flight.release(running.seq)  # the engine's end for the cancel frees the slot for the other connection
    assert p.engine.submitted()[-1] == other.seq


def test_a_reader_that_falls_behind_has_its_sequences_paused_also_as_they_start() -> None:
    p = Parts(capacity=1, max_unsent_per_client=1)
    p.connect(b"\x00A")
    first, second = p.submit(b"\x00A", "local", "1"), p.submit(b"\x00A", "local", "2")
    for n in range(3):
        p.transport.send(b"\x00A", {"n": n})  # nobody reads: the stream fills, then the outbox
    assert ("pause", first.seq) in p.engine.calls and ("pause", second.seq) not in p.engine.calls
    p.flight.release(first.seq)
    assert p.engine.calls[-2:] == [("submit", second.seq), ("pause", second.seq)]
    p.received(b"\x00A")
    p.transport.flush_outboxes()
    p.received(b"\x00A")
    p.transport.flush_outboxes()
    assert p.engine.calls[-1] == ("resume", second.seq)


def _write_tenants(path: Path, names: list[str]) -> None:
    path.write_text("".join(f'[tenants.{n}]\nkeys = ["{(n * 40)[:40]}"]\n' for n in names))


def test_a_tenant_reload_ends_the_requests_of_a_removed_tenant_and_no_others(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    _write_tenants(path, ["red", "blue"])
    p = Parts(load_tenants(path), capacity=2, tenants=path)
    p.connect(b"\x00R")
    p.connect(b"\x00B")
    red_running, blue = p.submit(b"\x00R", "red", "1"), p.submit(b"\x00B", "blue", "1")
    p.submit(b"\x00R", "red", "2")  # waits: both slots are taken
    path.write_text("not toml [")
    p.control.reload_tenants()
    assert set(p.flight.table.tenants) == {"red", "blue"}  # a file that does not load changes nothing
    _write_tenants(path, ["blue"])
    p.control.reload_tenants()
    assert set(p.flight.table.tenants) == {"blue"}
    [waiting_end] = p.received(b"\x00R")
    assert waiting_end["id"] == "2" and waiting_end["error"]["code"] == ErrorCode.UNAUTHORIZED.value
    assert red_running.muted and ("cancel", red_running.seq, "error", ErrorCode.UNAUTHORIZED.value) in p.engine.calls
    assert not blue.muted and p.received(b"\x00B") == []
    p.control.reload_tenants()  # the running one is told once
    assert len([c for c in p.engine.calls if c[0] == "cancel"]) == 1


def test_engine_events_become_messages_and_a_stop_ends_the_rest() -> None:
    async def main() -> None:
        p = Parts(capacity=1)
        p.flight.info = p.flight.tokenizer = None
        p.flight.status = "loading"
        ready: list[Ready] = []
        events = EngineEvents(p.flight, p.transport, ready.append)
        events.dispatch([Ready(INFO, Tokenizer())])
        assert p.flight.status == "ready" and p.flight.info is INFO and len(ready) == 1
        p.connect(b"\x00A")
        first, second = p.submit(b"\x00A", "local", "1"), p.submit(b"\x00A", "local", "2")
        events.dispatch([Tokens(first.seq, [1, 2]), _finished(first)])
        token, end = p.received(b"\x00A")
        assert token["text"] == "Hello" and end["id"] == "1" and end["finish_reason"] == FinishReason.LENGTH.value
        assert p.engine.submitted() == [first.seq, second.seq]
        events.dispatch([Stopped()])
        [shutdown] = p.received(b"\x00A")
        assert shutdown["id"] == "2" and shutdown["error"]["code"] == ErrorCode.SHUTDOWN.value
        assert events.done.is_set() and events.exit_code == 0 and len(p.flight.requests) == 0
        events.dispatch([Ready(INFO, Tokenizer())])  # after the end nothing more is handled
        assert len(ready) == 1

    anyio.run(main, backend="asyncio")


def test_steps_that_arrive_while_the_loop_is_busy_are_handled_as_one_in_order() -> None:
    """The engine's thread emits three steps before the reading task runs: one dispatch takes all
    three, in order; a later emit (here from the loop's own thread) wakes the task again."""

    async def main() -> None:
        p = Parts()
        events = EngineEvents(p.flight, p.transport, lambda sig: None)
        batches: list[list[Any]] = []
        events.dispatch = batches.append  # type: ignore[method-assign,assignment]

        def three_steps() -> None:
            for i in range(3):
                events.emit([Tokens(7, [i])])

        engine_thread = threading.Thread(target=three_steps)
        engine_thread.start()
        engine_thread.join()
        async with anyio.create_task_group() as tg:
            tg.start_soon(events.consume)
            with anyio.fail_after(10):
                while not batches:
                    await anyio.sleep(0.001)
                events.emit([Tokens(7, [9])])
                while len(batches) < 2:
                    await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
        assert [[sig.tokens for sig in batch] for batch in batches] == [[[0], [1], [2]], [[9]]]

    anyio.run(main, backend="asyncio")


def test_a_dead_engine_ends_everything_and_sets_the_exit_code() -> None:
    async def main() -> None:
        p = Parts()
        events = EngineEvents(p.flight, p.transport, lambda sig: None)
        p.connect(b"\x00A")
        p.submit(b"\x00A", "local", "1")
        events.dispatch([Dead("boom")])
        [end] = p.received(b"\x00A")
        assert end["error"]["code"] == ErrorCode.ENGINE_DEAD.value and events.exit_code == 1 and events.done.is_set()

    anyio.run(main, backend="asyncio")


def test_a_local_connection_is_a_connection_of_its_tenant_until_closed() -> None:
    p = Parts()
    conn = LocalConnection(p.intake, "local", p.transport.open_local(b"\x00L"), b"\x00L")
    conn.submit(Submit("1", tokens=[1, 2], max_tokens=1))
    t = p.flight.requests.get(("local", b"\x00L", "1"))
    assert t is not None and p.engine.submitted() == [t.seq]
    conn.cancel("1")
    assert p.engine.calls[-1] == ("cancel", t.seq, "cancelled", None)
    conn.close()
    assert not p.transport.is_local(b"\x00L") and len(p.flight.requests) == 0
    assert p.engine.calls[-1] == ("cancel", t.seq, "error", ErrorCode.DISCONNECTED.value)
    with pytest.raises(RuntimeError):
        conn.submit(Submit("2", tokens=[1], max_tokens=1))
    gone = LocalConnection(p.intake, "nobody", p.transport.open_local(b"\x00G"), b"\x00G")
    gone.submit(Submit("3", tokens=[1], max_tokens=1))
    [end] = [gone.events.receive_nowait()]
    assert end["id"] == "3" and end["error"]["code"] == ErrorCode.UNAUTHORIZED.value


def test_stats_and_health_read_the_parts() -> None:
    p = Parts(capacity=1)
    p.connect(b"\x00A")
    p.submit(b"\x00A", "local", "1")
    p.submit(b"\x00A", "local", "2")
    stats = p.control.stats()
    assert stats["requests_in_flight"] == 2 and stats["kv_reserved_bytes"] == p.flight.kv_reserved > 0
    reply = p.control.stats_reply(p.flight.table.tenants["local"], Stats("s"))
    assert reply["stats"]["requests_in_flight"] == 2
    assert p.control.health("h")["status"] == p.flight.status


def test_a_bucket_that_refilled_while_no_refill_was_due_still_starts_the_next_request(tmp_path: Path) -> None:
    """The race a loaded CI machine hit: the tenant's last request finished with its bucket spent,
    and the bucket refilled above zero before the refill loop looked again (nothing was "held back by
    its bucket" any more). The waiting request must still start, within a poll."""
    path = tmp_path / "tenants.toml"
    path.write_text(
        '[tenants.slow]\nkeys = ["' + "s" * 40 + '"]\ntoken_rate = 10.0\ntoken_burst = 5\nmax_concurrent = 1\n'
    )
    p = Parts(load_tenants(path), capacity=4, tenants=path)
    p.connect(b"\x00S")
    first, second = p.submit(b"\x00S", "slow", "1"), p.submit(b"\x00S", "slow", "2")
    assert p.engine.submitted() == [first.seq]  # one at a time
    p.flight.fair.generated(p.flight.table.tenants["slow"], 20)  # the bucket spent past zero
    p.flight.release(first.seq)
    assert p.engine.submitted() == [first.seq]  # the finish pumped, but the bucket is empty
    state = p.flight.fair.state["slow"]
    state.bucket = 1.0  # refilled meanwhile, and nothing pumped since

    async def main() -> None:
        with anyio.move_on_after(1.0):
            async with anyio.create_task_group() as tg:
                tg.start_soon(p.flight.pump_on_refill)
                while p.engine.submitted() == [first.seq]:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()

    anyio.run(main)
    assert p.engine.submitted() == [first.seq, second.seq]
