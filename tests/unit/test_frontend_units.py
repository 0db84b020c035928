"""The front end's pieces on their own, without a daemon: the request table's counts, engine events
turned into wire messages (stop strings, usage, outcomes), the stats reply as a tenant, as the
operator and across msgpack, in-process sending with its outbox and pausing, and the coordinator's
parts wired around an engine that only records: slots and the KV budget, the submit limits, cancel,
disconnect, pausing, tenant reload, engine events and in-process connections."""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest

from clients.protocol import ErrorCode, FinishReason, MsgType, Stats, Submit
from scheduler.admission import Limits
from scheduler.control import Control
from scheduler.engine_events import EngineEvents
from scheduler.fairness import FairQueue
from scheduler.flight import Flight
from scheduler.intake import Intake
from scheduler.local import LocalConnection
from scheduler.outputs import Outputs, refused_submit_end
from scheduler.requests import RequestTable, Tracked
from scheduler.settings import ConfigError, FrontEndSettings, load_table
from scheduler.stats import (
    Counters,
    TaxGate,
    build_stats,
    health_message,
    measure_tax_forbidden,
    stats_message,
    visible_tenant,
)
from scheduler.stats_types import StatsReply
from scheduler.stopping import StopStrings
from scheduler.tenants import Tenant, TenantTable, load_tenants
from scheduler.transport import Transport
from tests.helpers.stats import stats_snapshot
from workers.engine import Finished, Job, StepInfo, Timings, Tokens
from workers.jobs import EngineCounters
from workers.loop import Dead, Ready, Stopped
from workers.models import ModelInfo


def _tracked(table: RequestTable, client: bytes, tenant: str, rid: str, **req: Any) -> Tracked:
    t = Tracked(
        client=client, tenant=tenant, rid=rid, seq=table.next_seq(), received_at=0.0, req=Submit(rid, "p", **req)
    )
    table.add(t)
    return t


# ---------------------------------------------------------------------- request table


def test_request_table_counts_follow_requests_through_their_life() -> None:
    table = RequestTable()
    a1 = _tracked(table, b"A", "red", "1")
    a2 = _tracked(table, b"A", "red", "2")
    b1 = _tracked(table, b"B", "blue", "1")
    assert len(table) == 3 and table.client_count(b"A") == 2 and table.client_count(b"B") == 1
    assert table.waiting("red") == 2 and table.waiting("blue") == 1 and table.waiting() == 3
    assert ("red", b"A", "2") in table and table.get(("blue", b"B", "1")) is b1
    assert table.has_rid(b"A", "2") and not table.has_rid(b"B", "2")

    table.enter_engine(a1)  # running, no longer waiting, still the connection's
    assert a1.in_engine and table.by_seq(a1.seq) is a1
    assert table.waiting("red") == 1 and table.waiting() == 2 and table.client_count(b"A") == 2

    table.discard(a1)  # its end: gone by key, still findable by sequence until Finished
    assert table.client_count(b"A") == 1 and table.waiting("red") == 1 and table.by_seq(a1.seq) is a1
    assert table.pop_seq(a1.seq) is a1 and table.by_seq(a1.seq) is None

    table.discard(a2)  # ended while waiting
    assert table.waiting("red") == 0 and table.waiting() == 1 and table.client_count(b"A") == 0
    assert table.of_client(b"A") == [] and table.of_client(b"B") == [b1]
    assert list(table) == [b1]


def test_request_table_discard_leaves_a_newer_request_under_the_same_key() -> None:
    table = RequestTable()
    old = _tracked(table, b"A", "red", "x")
    table.discard(old)
    new = _tracked(table, b"A", "red", "x")
    table.discard(old)  # the old one's late end must not remove, or uncount, the new one
    assert table.holds(new) and not table.holds(old)
    assert table.client_count(b"A") == 1 and table.waiting("red") == 1 and table.waiting() == 1
    assert new.seq != old.seq


# ---------------------------------------------------------------------- outputs


class _Detok:
    """A detokenizer over a fixed vocabulary: each token is one piece of text."""

    def __init__(self, vocab: dict[int, str]) -> None:
        self.vocab = vocab
        self.last_segment = ""

    def add_token(self, tok: int) -> None:
        self.last_segment = self.vocab[tok]

    def finalize(self) -> None:
        self.last_segment = ""


VOCAB = {1: "Hel", 2: "lo", 3: " EN", 4: "D more", 5: "!"}


def _running(stop: list[str] | None = None, logprobs: bool = False) -> Tracked:
    table = RequestTable()
    t = _tracked(table, b"A", "red", "r1", stop=stop or [], logprobs=logprobs)
    t.detok = _Detok(VOCAB)
    t.stops = StopStrings(stop) if stop else None
    t.prompt_tokens = 7
    return t


def _finished(t: Tracked, reason: str = "length", **kw: Any) -> Finished:
    return Finished(t.seq, reason, t.prompt_tokens, t.completion_tokens, Timings(0.1, 0.2, 0.3, 0.6), **kw)  # type: ignore[arg-type]


def test_tokens_become_a_token_message_with_text_and_logprobs() -> None:
    out = Outputs()
    t = _running(logprobs=True)
    msg, hit = out.tokens(t, Tokens(t.seq, [1, 2], logprobs=[-0.5, -0.25]))
    assert not hit and msg["type"] == MsgType.TOKEN.value and msg["id"] == "r1"
    assert msg["tokens"] == [1, 2] and msg["text"] == "Hello" and msg["logprobs"] == [-0.5, -0.25]
    assert t.completion_tokens == 2

    [end] = out.finished(t, _finished(t))
    assert end["type"] == MsgType.END.value and end["finish_reason"] == FinishReason.LENGTH.value
    assert end["usage"] == {"prompt_tokens": 7, "completion_tokens": 2}
    assert out.completed == 1 and out.outcomes == {"red": {"length": 1}}


def test_a_stop_string_cuts_the_text_and_ends_with_stop() -> None:
    out = Outputs()
    t = _running(stop=["END"])
    msg, hit = out.tokens(t, Tokens(t.seq, [1, 2, 3, 4, 5]))
    assert hit and t.stopped
    assert msg["text"] == "Hello " and msg["tokens"] == [1, 2, 3, 4]  # nothing after the stop string's token
    [end] = out.finished(t, _finished(t, "cancelled"))  # the engine's end for the cancel it was sent
    assert end["finish_reason"] == FinishReason.STOP.value
    assert end["usage"]["completion_tokens"] == 4
    assert out.outcomes == {"red": {"stop": 1}}


def test_text_held_for_a_possible_stop_string_comes_out_at_the_end() -> None:
    out = Outputs()
    t = _running(stop=["ENDING"])
    msg, hit = out.tokens(t, Tokens(t.seq, [1, 3]))
    assert not hit and msg["text"] == "Hel "  # " EN" might begin "ENDING": held back
    tail, end = out.finished(t, _finished(t))
    assert tail["type"] == MsgType.TOKEN.value and tail["text"] == "EN" and tail["tokens"] == []
    assert end["finish_reason"] == FinishReason.LENGTH.value


def test_a_detached_request_gets_no_messages_but_is_counted() -> None:
    out = Outputs()
    t = _running()
    t.detached = True
    assert out.finished(t, _finished(t, "error", error_code=ErrorCode.DISCONNECTED.value)) == []
    assert out.ended_here(t, FinishReason.ERROR, (ErrorCode.DISCONNECTED, "gone")) is None
    assert out.outcomes == {"red": {"disconnected": 2}}


def test_an_end_given_here_carries_the_error_and_retry_hint() -> None:
    out = Outputs()
    t = _running()
    end = out.ended_here(t, FinishReason.ERROR, (ErrorCode.BUSY, "busy: try later"), 1.5)
    assert end is not None and end["finish_reason"] == FinishReason.ERROR.value
    assert end["error"]["code"] == ErrorCode.BUSY.value and end["error"]["retry_after_s"] == 1.5
    assert end["usage"]["prompt_tokens"] == 7 and out.outcomes == {"red": {"busy": 1}}
    refused = refused_submit_end("r9", (ErrorCode.BAD_FIELD, "no"))
    assert refused["id"] == "r9" and refused["error"]["code"] == ErrorCode.BAD_FIELD.value


def test_step_info_feeds_the_histograms() -> None:
    out = Outputs()
    out.step(StepInfo("decode", 0.01, 3))
    out.step(StepInfo("prefill", 0.02, 1))
    registry = out.obs.registry
    assert registry.get_sample_value("mlx_batchd_batch_size_count") == 1
    assert registry.get_sample_value("mlx_batchd_step_seconds_count", {"kind": "prefill"}) == 1


# ---------------------------------------------------------------------- stats


def _tenants() -> TenantTable:
    """A table as loaded from a tenants file (the path is only what marks it so)."""
    return TenantTable(
        {
            "red": Tenant("red", keys=frozenset({"k-red"})),
            "blue": Tenant("blue", keys=frozenset({"k-blue"})),
            "ops": Tenant("ops", keys=frozenset({"k-ops"}), admin=True),
        },
        source=Path("tenants.toml"),
    )


def _stats(only: str | None) -> StatsReply:
    table = _tenants()
    return build_stats(
        only=only,
        uptime_s=1.0,
        tenants=table.tenants,
        fair=FairQueue(),
        counters=Counters(received=5, refused=1),
        completed=3,
        outcomes={"red": {"stop": 2}, "blue": {"length": 1}},
        requests_in_flight=0,
        kv_reserved_bytes=0,
        kv_budget_bytes=0,
        clients_paused=0,
        unsent_messages=0,
        engine={},
    )


def test_a_tenant_sees_its_own_rows_and_the_operator_sees_all() -> None:
    table = _tenants()
    assert visible_tenant(table, table.tenants["red"]) == "red"
    assert visible_tenant(table, table.tenants["ops"]) is None
    mine = _stats(visible_tenant(table, table.tenants["red"]))
    assert set(mine["tenants"]) == {"red"} and mine["outcomes"] == {"red": {"stop": 2}}
    everything = _stats(visible_tenant(table, table.tenants["ops"]))
    assert set(everything["tenants"]) == {"red", "blue", "ops"} and set(everything["outcomes"]) == {"red", "blue"}
    assert mine["messages_received"] == everything["messages_received"] == 5  # aggregates for both
    assert stats_message("s1", mine)["stats"] is mine


def test_without_a_tenants_file_the_local_user_is_the_operator() -> None:
    from scheduler.tenants import LOCAL, local_table

    table = local_table()
    assert visible_tenant(table, table.tenants[LOCAL]) is None


def test_measure_tax_is_let_through_once_per_interval() -> None:
    gate = TaxGate(30.0)
    assert gate.ask(100.0) == "queued"
    assert gate.ask(110.0) == "skipped"
    assert gate.ask(131.0) == "queued"
    assert measure_tax_forbidden("s2").code == ErrorCode.FORBIDDEN


def test_the_engine_counters_reach_the_reply_whole() -> None:
    """Every counter of ``EngineCounters`` has its key in ``stats.engine``, under its own name."""
    counters = EngineCounters(**{f.name: i + 1 for i, f in enumerate(fields(EngineCounters))})
    assert counters.snapshot() == asdict(counters)


def test_the_stats_reply_crosses_msgpack_as_plain_strings() -> None:
    """Enum-valued fields (``measure_tax``, levels) leave as their plain strings: clients and the HTTP
    door read the same map as before the reply had types."""
    stats = _stats(None)
    stats["measure_tax"] = TaxGate(30.0).ask(0.0)
    stats["engine"] = stats_snapshot(1.0, 0, 0, 0, 0)["engine"]
    wire = msgpack.unpackb(msgpack.packb(stats_message("s1", stats)))["stats"]
    assert wire == stats
    assert type(wire["measure_tax"]) is str and wire["measure_tax"] == "queued"
    assert type(wire["engine"]["pins"]["pinned"][0]["level"]) is str


def test_health_reports_limits_before_the_model_is_loaded() -> None:
    msg = health_message("h", "loading", None, Limits(), 1234)
    assert msg["model"] is None and msg["status"] == "loading" and msg["limits"]["max_frame_bytes"] == 1234


# ---------------------------------------------------------------------- transport (in-process)


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


# ---------------------------------------------------------------------- the coordinator's parts


class _Engine:
    """An engine handle that only records what it was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def start(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def snapshot(self) -> dict[str, Any]:
        return {}

    def submit(self, job: Job) -> None:
        self.calls.append(("submit", job.seq))

    def cancel(self, seq: int, reason: str = "cancelled", code: str | None = None, message: str | None = None) -> None:
        self.calls.append(("cancel", seq, reason, code))

    def pause(self, seq: int) -> None:
        self.calls.append(("pause", seq))

    def resume(self, seq: int) -> None:
        self.calls.append(("resume", seq))

    def measure_tax(self) -> None:
        self.calls.append(("measure_tax",))

    def shutdown(self, reason: str = "error", code: str = "shutdown", message: str = "") -> None:
        self.calls.append(("shutdown",))

    def submitted(self) -> list[int]:
        return [c[1] for c in self.calls if c[0] == "submit"]


class _Tokenizer:
    @property
    def detokenizer(self) -> _Detok:
        return _Detok(VOCAB)


INFO = ModelInfo("m", "m", "llama", 100, 1000, (0,), False, kv_bytes_per_token=10)


class _Parts:
    """The front end's parts wired as ``FrontEnd`` wires them, around a recording engine, with the
    model already loaded; connections are in-process, so every message sent can be read back."""

    def __init__(self, table: TenantTable | None = None, **settings: Any) -> None:
        self.settings = FrontEndSettings("ipc:///unused", **settings)
        self.counters = Counters()
        self.transport = Transport(
            self.settings.listen,
            max_frame_bytes=self.settings.max_frame_bytes,
            max_unsent_per_client=self.settings.max_unsent_per_client,
            on_gone=lambda client, why: self.control.drop_client(client, why),
            on_pause=lambda client, paused: self.control.set_paused(client, paused),
        )
        self.flight = Flight(self.settings, Outputs(), self.transport.send, self.transport.is_paused)
        self.control = Control(self.settings, self.flight, self.transport, self.counters)
        self.intake = Intake(self.settings, self.flight, self.transport, self.control, self.counters)
        self.engine = _Engine()
        self.flight.engine = self.engine
        self.flight.info, self.flight.tokenizer = INFO, _Tokenizer()
        if table is not None:
            self.flight.table = table
        self.inbox: dict[bytes, Any] = {}

    def connect(self, client: bytes) -> None:
        self.inbox[client] = self.transport.open_local(client)

    def submit(self, client: bytes, tenant: str, rid: str, max_tokens: int = 2) -> Tracked:
        self.intake.submit(
            client, self.flight.table.tenants[tenant], Submit(rid, tokens=[1, 2, 3], max_tokens=max_tokens)
        )
        t = self.flight.requests.get((tenant, client, rid))
        assert t is not None
        return t

    def received(self, client: bytes) -> list[dict[str, Any]]:
        out = []
        while True:
            try:
                out.append(self.inbox[client].receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):  # nothing more now, or the connection was forgotten
                return out


def test_waiting_requests_fill_the_free_slots_and_a_finish_starts_the_next() -> None:
    p = _Parts(capacity=2)
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
    p = _Parts(kv_budget_bytes=2 * need)
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
    p = _Parts(kv_budget_bytes=3 * need, prefix_cache_bytes=need)
    p.connect(b"\x00A")
    first, second, third = (p.submit(b"\x00A", "local", rid) for rid in ("1", "2", "3"))
    assert p.engine.submitted() == [first.seq, second.seq] and not third.in_engine
    p.intake.submit(b"\x00A", p.flight.table.tenants["local"], Submit("big", tokens=[1, 2, 3], max_tokens=8))
    [end] = p.received(b"\x00A")
    assert end["error"]["code"] == ErrorCode.KV_BUDGET.value and "prefix cache" in end["error"]["message"]
    with pytest.raises(ConfigError, match="counted in the KV budget"):
        load_table(FrontEndSettings("ipc:///unused", kv_budget_bytes=need, prefix_cache_bytes=need))


def test_limits_refuse_a_duplicate_id_a_full_connection_and_a_closing_daemon() -> None:
    p = _Parts(capacity=1, max_inflight_per_client=2)
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
    p = _Parts(capacity=1)
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
    p = _Parts(capacity=1)
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
    p = _Parts(capacity=1, max_unsent_per_client=1)
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
    p = _Parts(load_tenants(path), capacity=2, tenants=path)
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
        p = _Parts(capacity=1)
        p.flight.info = p.flight.tokenizer = None
        p.flight.status = "loading"
        ready: list[Ready] = []
        events = EngineEvents(p.flight, p.transport, ready.append)
        events.dispatch([Ready(INFO, _Tokenizer())])
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
        events.dispatch([Ready(INFO, _Tokenizer())])  # after the end nothing more is handled
        assert len(ready) == 1

    anyio.run(main, backend="asyncio")


def test_a_dead_engine_ends_everything_and_sets_the_exit_code() -> None:
    async def main() -> None:
        p = _Parts()
        events = EngineEvents(p.flight, p.transport, lambda sig: None)
        p.connect(b"\x00A")
        p.submit(b"\x00A", "local", "1")
        events.dispatch([Dead("boom")])
        [end] = p.received(b"\x00A")
        assert end["error"]["code"] == ErrorCode.ENGINE_DEAD.value and events.exit_code == 1 and events.done.is_set()

    anyio.run(main, backend="asyncio")


def test_a_local_connection_is_a_connection_of_its_tenant_until_closed() -> None:
    p = _Parts()
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
    p = _Parts(capacity=1)
    p.connect(b"\x00A")
    p.submit(b"\x00A", "local", "1")
    p.submit(b"\x00A", "local", "2")
    stats = p.control.stats()
    assert stats["requests_in_flight"] == 2 and stats["kv_reserved_bytes"] == p.flight.kv_reserved > 0
    reply = p.control.stats_reply(p.flight.table.tenants["local"], Stats("s", measure_tax=True))
    assert reply["stats"]["measure_tax"] == "queued" and p.engine.calls[-1] == ("measure_tax",)
    assert p.control.health("h")["status"] == p.flight.status
