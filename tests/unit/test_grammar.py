"""The grammar processor on the demo model's tokenizer, step by step as ``BatchGenerator`` drives it:
the mask allows exactly the grammar's next tokens, end-of-sequence only where the grammar accepts
(and then only it once the grammar is complete), the matcher advances by what the sampler drew; the
wire's ``response_format`` parses, round-trips and refuses bad shapes; OpenAI's shape maps to it;
a grammar that cannot compile is named."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import pytest

from clients.messages import submit_message
from clients.parse import parse_request, parse_response_format
from clients.protocol import ProtocolError, SamplingOptions, Submit
from scheduler.response_format import check, from_openai
from workers.api.grammar import compile_error, grammar_text, lltokenizer
from workers.engine.grammar_mask import GrammarState
from workers.models.demo import demo_path
from workers.models.loading import load_tokenizer

EOS = 0
VOCAB = 257


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(str(demo_path()))


def allowed(row: mx.array) -> set[int]:
    return {i for i, v in enumerate(row[0].tolist()) if v != float("-inf")}


def drive(state: GrammarState, pick: int) -> set[int]:
    """One step: the processor masks a row of zeros; the sampler draws ``pick`` from it (a one-hot
    row, so the wrapped greedy sampler returns it); what the processor allowed comes back."""
    masked = state.processor(mx.zeros((1, 1)), mx.zeros((1, VOCAB)))
    ok = allowed(masked)
    onehot = mx.where(mx.arange(VOCAB) == pick, 0.0, -1.0)[None]
    assert int(state.sampler(onehot).item()) == pick
    return ok


def test_the_mask_follows_the_grammar_and_eos_waits_for_acceptance(tokenizer: Any) -> None:
    lltok = lltokenizer(tokenizer, VOCAB)
    state = GrammarState(lltok, grammar_text("regex", "ab(c)?"), {EOS}, None)
    a, b, c = (tokenizer.encode(ch)[0] for ch in "abc")
    assert drive(state, a) == {a}  # nothing else, and no EOS before the grammar accepts
    assert drive(state, b) == {b}
    assert drive(state, c) == {c, EOS}  # "ab" is accepted: EOS or the optional "c"
    assert drive(state, EOS) == {EOS}  # "abc" is complete: only EOS
    assert state.matcher.is_accepting() and not state.matcher.is_error()


def test_a_json_schema_walk_masks_every_wrong_byte(tokenizer: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    state = GrammarState(lltokenizer(tokenizer, VOCAB), grammar_text("json_schema", json.dumps(schema)), {EOS}, None)
    for token in tokenizer.encode('{"n": 42}'):
        ok = drive(state, token)
        assert token in ok and EOS not in ok and len(ok) < VOCAB
    assert EOS in drive(state, EOS)


def test_the_stop_ids_count_as_end_of_sequence(tokenizer: Any) -> None:
    stop = tokenizer.encode("z")[0]
    state = GrammarState(lltokenizer(tokenizer, VOCAB), grammar_text("regex", "a+"), {EOS, stop}, None)
    a = tokenizer.encode("a")[0]
    assert drive(state, a) == {a}
    assert drive(state, a) == {a, EOS, stop}


@pytest.mark.parametrize(
    ("kind", "text", "named"),
    [
        ("json_schema", json.dumps({"type": "nope"}), "nope"),
        ("regex", "(unclosed", ""),
        ("grammar", "start: missing", "missing"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_naming_the_field(
    tokenizer: Any, kind: str, text: str, named: str
) -> None:
    assert compile_error(grammar_text(kind, text), lltokenizer(tokenizer, VOCAB)) is not None
    req = Submit(id="r", prompt="x", sampling=SamplingOptions(response_format=(kind, text)))
    with pytest.raises(ProtocolError) as info:
        check(req, tokenizer, VOCAB)
    assert info.value.code == "bad_field" and "'response_format'" in info.value.message and named in info.value.message


def test_the_wire_field_parses_and_round_trips() -> None:
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    for value, want in [
        ({"type": "json_schema", "schema": schema}, ("json_schema", json.dumps(schema))),
        ({"type": "json_object"}, ("json_object", "")),
        ({"type": "regex", "pattern": "a+"}, ("regex", "a+")),
        ({"type": "grammar", "grammar": 'start: "x"'}, ("grammar", 'start: "x"')),
        ({"type": "text"}, None),
    ]:
        msg = {"v": 1, "type": "submit", "id": "r", "prompt": "x", "response_format": value}
        req = parse_request(msg)
        assert isinstance(req, Submit) and req.sampling.response_format == want
        assert req.sampling.has_processors == (want is not None)
        again = parse_request(submit_message(req))
        assert isinstance(again, Submit) and again.sampling.response_format == want
    parsed = parse_response_format({"type": "json_schema", "schema": schema}, "r")
    assert parsed is not None and list(json.loads(parsed[1])["properties"]) == ["b", "a"]  # the schema's order kept


@pytest.mark.parametrize(
    "value",
    [
        {"type": "xml"},
        {"type": 3},
        {"type": "json_schema"},
        {"type": "json_schema", "schema": [1]},
        {"type": "json_schema", "schema": {"x": b"bytes"}},
        {"type": "regex", "pattern": ""},
        {"type": "grammar", "grammar": 5},
    ],
)
def test_bad_shapes_are_bad_field(value: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_response_format(value, "r")
    assert info.value.code == "bad_field" and "'response_format'" in info.value.message


def test_min_tokens_is_refused_with_a_response_format() -> None:
    """A grammar that is complete allows only end-of-sequence, which ``min_tokens`` forbids: nothing
    would be left to sample, so the pair is refused rather than one of them silently dropped."""
    msg = {
        "v": 1,
        "type": "submit",
        "id": "r",
        "prompt": "x",
        "min_tokens": 2,
        "response_format": {"type": "json_object"},
    }
    with pytest.raises(ProtocolError, match="'min_tokens' cannot be combined with 'response_format'"):
        parse_request(msg)


def test_openai_shapes_map_to_the_wire() -> None:
    schema = {"type": "object"}
    assert from_openai({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}) == {
        "type": "json_schema",
        "schema": schema,
    }
    assert from_openai({"type": "json_schema", "json_schema": {"name": "x"}}) == {"type": "json_object"}
    assert from_openai({"type": "json_object"}) == {"type": "json_object"}
    assert from_openai(None) is None
    for bad in (
        "json",
        {"type": "json_schema", "json_schema": 1},
        {"type": "json_schema", "json_schema": {"schema": 1}},
    ):
        with pytest.raises(ProtocolError, match="'response_format'"):
            from_openai(bad)


def test_the_grammar_crosses_to_an_engine_process_with_the_job() -> None:
    from scheduler.engine_process import pack, unpack
    from workers.api import Job, SamplingParams, SubmitJob, from_wire, to_wire

    job = Job(seq=1, prompt=[1, 2], max_tokens=4, sampling=SamplingParams(grammar=grammar_text("regex", "a+")))
    assert from_wire("command", unpack(pack(to_wire(SubmitJob(job))))) == SubmitJob(job)
