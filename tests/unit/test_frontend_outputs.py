"""The front end's request records and messages, without a daemon: the request table's counts
through a request's life, and engine events turned into wire messages (stop strings, usage,
outcomes, ends given by the front end itself, the step histograms)."""

from __future__ import annotations

from typing import Any

from clients.protocol import ErrorCode, FinishReason, MsgType, Submit
from scheduler.outputs import Outputs, refused_submit_end
from scheduler.requests import RequestTable, Tracked
from scheduler.stopping import StopStrings
from tests.helpers.frontend import VOCAB, _Detok, _finished
from workers.api import StepInfo, Tokens


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


def _running(stop: list[str] | None = None, logprobs: bool = False) -> Tracked:
    table = RequestTable()
    t = _tracked(table, b"A", "red", "r1", stop=stop or [], logprobs=logprobs)
    t.detok = _Detok(VOCAB)
    t.stops = StopStrings(stop) if stop else None
    t.prompt_tokens = 7
    return t


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
