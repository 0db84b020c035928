"""The wire format and the pure-Python pieces around it, without a daemon."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.events import EndEvent, TokenEvent, event_from_message
from clients.messages import submit_message
from clients.parse import parse_request
from clients.protocol import PROTOCOL_VERSION, ErrorCode, ProtocolError, SamplingOptions, Submit, unpack
from scheduler.admission import Limits, admit
from scheduler.stopping import StopStrings
from workers.api import ModelInfo

INFO = ModelInfo("m", "/m", "llama", vocab_size=100, context_length=50, eos_token_ids=(0,), has_chat_template=False)


def test_submit_round_trips_through_the_wire() -> None:
    req = Submit(
        id="a",
        tokens=[1, 2],
        max_tokens=7,
        sampling=SamplingOptions(0.7, 0.9, 40, 0.05, 3),
        stop=["\n\n"],
        stop_token_ids=[9],
        logprobs=True,
    )
    assert parse_request(unpack(msgpack.packb(submit_message(req)))) == req


def test_a_declared_group_round_trips_and_bad_ones_are_refused() -> None:
    req = Submit(id="a", tokens=[1], group=("batch-7", 4))
    assert parse_request(unpack(msgpack.packb(submit_message(req)))) == req
    base = {"v": PROTOCOL_VERSION, "type": "submit", "id": "a", "tokens": [1]}
    for extra, says in (
        ({"group": "g"}, "go together"),
        ({"group_size": 2}, "go together"),
        ({"group": "", "group_size": 2}, "1 to 128 characters"),
        ({"group": "g" * 129, "group_size": 2}, "1 to 128 characters"),
        ({"group": "g", "group_size": 0}, "must be in [1, 4096]"),
        ({"group": "g", "group_size": 4097}, "must be in [1, 4096]"),
        ({"group": "g", "group_size": True}, "must be int"),
        ({"group": 5, "group_size": 2}, "must be str"),
    ):
        with pytest.raises(ProtocolError) as caught:
            parse_request({**base, **extra})
        assert caught.value.code == ErrorCode.BAD_FIELD and says in str(caught.value), (extra, str(caught.value))


def test_single_stop_string_is_accepted() -> None:
    req = parse_request({"v": PROTOCOL_VERSION, "type": "submit", "id": "a", "prompt": "x", "stop": "END"})
    assert isinstance(req, Submit) and req.stop == ["END"]


@pytest.mark.parametrize(
    "fields,code",
    [
        ({"tokens": [1], "max_tokens": 5000}, ErrorCode.MAX_TOKENS_OUT_OF_RANGE),
        ({"tokens": [1] * 50}, ErrorCode.PROMPT_TOO_LONG),
        ({"tokens": [1] * 45, "max_tokens": 6}, ErrorCode.MAX_TOKENS_OUT_OF_RANGE),
        ({"tokens": [100]}, ErrorCode.TOKEN_OUT_OF_RANGE),
        ({"tokens": [1], "stop_token_ids": [100]}, ErrorCode.BAD_FIELD),
    ],
)
def test_admission_refusals(fields: dict[str, Any], code: ErrorCode) -> None:
    req = parse_request({"v": PROTOCOL_VERSION, "type": "submit", "id": "a", **fields})
    assert isinstance(req, Submit)
    with pytest.raises(ProtocolError) as info:
        admit(req, list(req.tokens or []), INFO, Limits(max_tokens_cap=100, default_max_tokens=16))
    assert info.value.code == code
    assert info.value.request_id == "a"


def test_default_max_tokens_fits_the_context() -> None:
    req = parse_request({"v": PROTOCOL_VERSION, "type": "submit", "id": "a", "tokens": [1] * 45})
    assert isinstance(req, Submit)
    assert admit(req, [1] * 45, INFO, Limits(default_max_tokens=16)).max_tokens == 5


def test_chat_without_template_is_refused() -> None:
    from scheduler.admission import prompt_ids

    req = parse_request(
        {"v": PROTOCOL_VERSION, "type": "submit", "id": "a", "messages": [{"role": "user", "content": "x"}]}
    )
    assert isinstance(req, Submit)
    with pytest.raises(ProtocolError) as info:
        prompt_ids(req, None, INFO)
    assert info.value.code == ErrorCode.NO_CHAT_TEMPLATE


def _stream_through(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """Feed text piece by piece as the front end does; flush if no stop string completed."""
    s = StopStrings(stops)
    out, matched = "", False
    for p in pieces:
        text, matched = s.feed(p)
        out += text
        if matched:
            break
    if not matched:
        out += s.flush()
    return out, matched


@pytest.mark.parametrize(
    "pieces,stops,emitted,hit",
    [
        (["hel", "lo wor", "ld"], ["lo w"], "hel", True),
        (["a", "b", "c"], ["bc"], "a", True),
        (["ab", "x"], ["bc"], "abx", False),  # a held-back 'b' is released once 'x' rules it out
        (["end"], ["xyz"], "end", False),
        (["ab", "cd"], ["d", "bc"], "a", True),  # the earliest stop wins
    ],
)
def test_stop_strings(pieces: list[str], stops: list[str], emitted: str, hit: bool) -> None:
    out, matched = _stream_through(pieces, stops)
    assert (out, matched) == (emitted, hit)


@given(
    st.lists(st.text(alphabet="abc", max_size=4), max_size=8),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_stop_strings_match_a_plain_search(pieces: list[str], stops: list[str]) -> None:
    """Streaming in any split equals reading the whole text a character at a time and cutting it
    before the first stop string to complete (of two completing together, the longer)."""
    full = "".join(pieces)
    out, matched = _stream_through(pieces, stops)
    want, hit = full, False
    for end in range(1, len(full) + 1):
        starts = [end - len(x) for x in stops if full[:end].endswith(x)]
        if starts:
            want, hit = full[: min(starts)], True
            break
    assert out == want and matched == hit


def test_a_stop_string_that_completes_first_wins_whatever_the_split() -> None:
    """``a`` completes (at 2) before ``baa`` (at 3) could: the cut is before ``a``, in one piece or two."""
    assert _stream_through(["baa"], ["a", "baa"]) == ("b", True)
    assert _stream_through(["ba", "a"], ["a", "baa"]) == ("b", True)


def test_client_events_from_messages() -> None:
    tok = event_from_message({"type": "token", "id": "a", "tokens": [1], "text": "x"})
    assert tok == TokenEvent("a", [1], "x", None)
    end = event_from_message({"type": "error", "id": "a", "code": "bad_field", "message": "m"})
    assert isinstance(end, EndEvent) and end.error is not None and end.error.code == "bad_field"


# ------------------------------------------------------------------ fuzzing the decoder

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.integers(-(2**63), 2**63), children, max_size=5)
    ),
    max_leaves=20,
)
field_names = st.sampled_from(
    [
        "v",
        "type",
        "id",
        "prompt",
        "tokens",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "logprobs",
    ]
)
near_valid = st.fixed_dictionaries(
    {
        "v": st.sampled_from([1, 1, 1, 2, "1", None]),
        "type": st.sampled_from(["submit", "cancel", "health", "stats", "x"]),
        "id": st.text(max_size=5) | st.integers(-(2**63), 2**63),
    },
    optional={"prompt": st.text(max_size=10), "tokens": st.lists(msgpack_values, max_size=4)},
).flatmap(lambda d: st.dictionaries(field_names, msgpack_values, max_size=4).map(lambda extra: {**d, **extra}))


def _decode(frame: bytes) -> None:
    try:
        parse_request(unpack(frame, max_bytes=4096))
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode) and exc.message


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_decoder_survives_arbitrary_bytes(frame: bytes) -> None:
    _decode(frame)


@settings(max_examples=2000, deadline=None)
@given(msgpack_values | near_valid)
def test_decoder_survives_arbitrary_msgpack(value: Any) -> None:
    _decode(msgpack.packb(value, use_bin_type=True))


def test_a_batch_carries_events_in_order_and_anything_else_is_one_event() -> None:
    from clients.messages import batch_message, end_message, token_message, unbatch
    from clients.protocol import FinishReason, pack

    first = token_message("a", [1], "x", None)
    second = end_message("a", FinishReason.LENGTH, {"prompt_tokens": 1, "completion_tokens": 1}, {}, None)
    msg = unpack(pack(batch_message([first, second])))
    assert unbatch(msg) == [first, second]
    assert unbatch(first) == [first]
    assert unbatch({"type": "batch", "events": "nope"}) == []
    assert unbatch({"type": "batch", "events": [1, first]}) == [first]


# ------------------------------------------------------------------ every field range-checked where it enters

MAX_COUNT, MAX_SEED = 2**31 - 1, 2**63 - 1  # the wire's documented bounds (int32 counts, int64 seeds)
SUBMIT_FIELDS = [
    "prompt", "tokens", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "logprobs", "top_logprobs", "priority", "group", "group_size", "batch",
]  # fmt: skip
edge_ints = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, 10**400])
numbers = st.integers() | edge_ints | st.floats()
field_values = numbers | st.lists(numbers, max_size=3) | st.text(max_size=3) | st.booleans() | st.none()


@settings(max_examples=1500, deadline=None)
@given(st.dictionaries(st.sampled_from(SUBMIT_FIELDS), field_values, max_size=4))
def test_an_accepted_submit_holds_only_values_msgpack_and_the_engine_take(extra: dict[str, Any]) -> None:
    """Any integer (JSON has no bound) or float in any field: refused by code, or accepted within
    the documented ranges, so the engine's job packs."""
    from workers.api import Job, SamplingParams, SubmitJob, to_wire

    try:
        req = parse_request({"v": PROTOCOL_VERSION, "type": "submit", "id": "a", "tokens": [1], **extra})
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode) and exc.message and len(exc.message) < 300
        return
    assert isinstance(req, Submit)
    s = req.sampling
    assert 0 <= s.temperature <= 100 and 0 < s.top_p <= 1 and 0 <= s.min_p <= 1 and 0 <= s.top_k <= MAX_COUNT
    assert s.seed is None or 0 <= s.seed <= MAX_SEED
    assert req.max_tokens is None or 1 <= req.max_tokens <= MAX_COUNT
    assert all(0 <= t <= MAX_COUNT for t in [*(req.tokens or []), *req.stop_token_ids])
    sampling = SamplingParams(s.temperature, s.top_p, s.top_k, s.min_p, s.seed)
    job = Job(
        seq=1,
        prompt=list(req.tokens or [1]),
        max_tokens=req.max_tokens or 1,
        sampling=sampling,
        stop_token_ids=tuple(req.stop_token_ids),
        top_logprobs=req.top_logprobs,
        group_size=0 if req.group is None else req.group[1],
    )
    msgpack.packb(to_wire(SubmitJob(job)), use_bin_type=True)


@pytest.mark.parametrize("name", ["v", "type", "id", *SUBMIT_FIELDS])
def test_a_value_nested_near_the_recursion_limit_is_refused_by_code(name: str) -> None:
    """No refusal describes a client's container by its repr (which recurses): nested 990 deep it
    is a ``ProtocolError`` like any other, never a ``RecursionError``."""
    deep: Any = 1
    for _ in range(990):
        deep = [deep]
    with pytest.raises(ProtocolError):
        parse_request({"v": PROTOCOL_VERSION, "type": "submit", "id": "a", "tokens": [1], name: deep})
