"""The front end's pieces on their own, without a daemon: the request table's counts, engine events
turned into wire messages (stop strings, usage, outcomes), the stats reply as a tenant and as the
operator, and in-process sending with its outbox and pausing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from clients.protocol import ErrorCode, FinishReason, MsgType, Submit
from scheduler.admission import Limits
from scheduler.fairness import FairQueue
from scheduler.outputs import Outputs, refused_submit_end
from scheduler.requests import RequestTable, Tracked
from scheduler.stats import (
    Counters,
    TaxGate,
    build_stats,
    health_message,
    measure_tax_forbidden,
    stats_message,
    visible_tenant,
)
from scheduler.stopping import StopStrings
from scheduler.tenants import Tenant, TenantTable
from scheduler.transport import Transport
from workers.engine import Finished, StepInfo, Timings, Tokens


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


def _stats(only: str | None) -> dict[str, Any]:
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
