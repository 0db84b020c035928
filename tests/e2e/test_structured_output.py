"""Structured output through a real daemon (demo model) and the client library: what a JSON schema,
any JSON object, a regex or a Lark grammar asks for is what comes out, in a batch too; the plain
requests of a mixed batch are byte-equal to a run without the constrained ones; a lone constrained
request keeps its bursts (no decline counted); a schema the engine cannot compile is refused
with ``bad_field`` naming the field, and the daemon serves on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from pydantic import BaseModel, Field

from clients import Client, RequestError
from clients.protocol import PROTOCOL_VERSION, pack, unpack
from tests.conftest import Daemon, start_daemon
from tests.helpers.daemons import served


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    member: bool


SCHEMA = Person.model_json_schema() | {"additionalProperties": False}  # strict, as OpenAI's strict mode asks
PROMPTS = ["The capital of France is", "Once upon a time", "def main():", "Alice and Bob"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The demo model with bursts on (prompt lookup), so a lone constrained request meets the burst decision."""
    yield from served(
        start_daemon("demo", tmp_path_factory.mktemp("structured"), "--draft", "prompt-lookup", "-k", "3")
    )


def schema_format(schema: dict[str, Any] = SCHEMA) -> dict[str, Any]:
    return {"type": "json_schema", "schema": schema}


def test_a_json_schema_batch_always_parses(client: Client) -> None:
    results = client.generate_many(
        [
            {"prompt": p, "max_tokens": 80, "temperature": t, "seed": 3, "response_format": schema_format()}
            for p in PROMPTS
            for t in (0.0, 1.0)
        ]
    )
    for r in results:
        assert r.finish_reason == "stop", r
        Person.model_validate_json(r.text)  # raises unless the text parses against the schema


def test_json_object_regex_and_grammar(client: Client) -> None:
    obj = client.generate("Hello", max_tokens=120, response_format={"type": "json_object"})
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict), obj
    rx = client.generate("Call me at", max_tokens=40, response_format={"type": "regex", "pattern": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", rx.text) and rx.finish_reason == "stop", rx
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,2}/'
    gr = client.generate("Is it?", max_tokens=20, response_format={"type": "grammar", "grammar": lark})
    assert re.fullmatch(r"yes|no|maybe [0-9]{1,2}", gr.text) and gr.finish_reason == "stop", gr


def test_plain_requests_of_a_mixed_batch_are_unchanged(client: Client) -> None:
    plain = [{"prompt": p, "max_tokens": 40} for p in PROMPTS]
    alone = client.generate_many(plain)
    constrained = [{"prompt": p, "max_tokens": 60, "response_format": schema_format()} for p in PROMPTS]
    mixed = client.generate_many([x for pair in zip(plain, constrained) for x in pair])
    assert [r.tokens for r in mixed[0::2]] == [r.tokens for r in alone]
    assert [r.text for r in mixed[0::2]] == [r.text for r in alone]
    for r in mixed[1::2]:
        Person.model_validate_json(r.text)


def test_a_lone_constrained_request_keeps_its_bursts(client: Client) -> None:
    declined = client.stats()["engine"]["bursts"]["declined"]
    before = declined.get("grammar", 0), declined.get("logits_processors", 0)
    r = client.generate("The capital of France is", max_tokens=60, response_format=schema_format())
    Person.model_validate_json(r.text)
    declined = client.stats()["engine"]["bursts"]["declined"]
    assert (declined.get("grammar", 0), declined.get("logits_processors", 0)) == before


@pytest.mark.parametrize(
    ("response_format", "names"),
    [
        ({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "schema"),
        ({"type": "regex", "pattern": "(unclosed"}, "pattern"),
        ({"type": "grammar", "grammar": "start: missing_rule"}, "grammar"),
        ({"type": "json_schema", "schema": ["not", "a", "schema"]}, "schema"),
        ({"type": "xml"}, "type"),
    ],
    ids=["bad-type", "bad-regex", "bad-lark", "not-an-object", "unknown-kind"],
)
def test_a_format_that_cannot_compile_is_bad_field(
    daemon: Daemon, client: Client, response_format: dict[str, Any], names: str
) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)  # a raw map: the daemon's own answer, past the client's checks
    sock.connect(daemon.address)
    try:
        sock.send(
            pack(
                {
                    "v": PROTOCOL_VERSION,
                    "type": "submit",
                    "id": f"bad-{names}",
                    "prompt": "Hi",
                    "response_format": response_format,
                }
            )
        )
        assert sock.poll(60_000), "no answer"
        end = unpack(sock.recv())
    finally:
        sock.close(linger=0)
    assert end["type"] == "end" and end["finish_reason"] == "error", end
    assert (
        end["error"]["code"] == "bad_field"
        and "'response_format'" in end["error"]["message"]
        and names in end["error"]["message"]
    ), end
    assert client.generate("Hi", max_tokens=4).finish_reason == "length"  # nothing else disturbed


def test_the_client_checks_the_shape_itself(client: Client) -> None:
    with pytest.raises(Exception, match="'response_format' has type 'xml'"):
        client.generate("Hi", response_format={"type": "xml"})
    with pytest.raises(RequestError, match="'response_format' has a pattern"):
        client.generate("Hi", response_format={"type": "regex", "pattern": "(unclosed"})


class Answer(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_the_real_model_answers_in_the_schema_over_zmq_and_http(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SmolLM2-135M (about ten tokens a second here): its JSON parses, through the client library and
    through ``chat.completions.parse`` with a pydantic model."""
    import openai

    from tests.e2e.test_http import http_url

    schema = Answer.model_json_schema() | {"additionalProperties": False}
    question = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    d = start_daemon(smollm2_dir, tmp_path_factory.mktemp("smollm-structured"), "--context-length", "256",
                     "--http", "127.0.0.1:0")  # fmt: skip
    try:
        with Client(d.address, timeout=300) as c:
            r = c.generate(messages=question, max_tokens=48, response_format={"type": "json_schema", "schema": schema})
        assert r.finish_reason == "stop", r
        Answer.model_validate_json(r.text)
        with openai.OpenAI(base_url=f"{http_url(d)}/v1", api_key="none", max_retries=0, timeout=300) as oai:
            got = oai.chat.completions.parse(
                model=oai.models.list().data[0].id,
                messages=question,
                response_format=Answer,
                max_tokens=48,  # type: ignore[arg-type]
            )
        assert isinstance(got.choices[0].message.parsed, Answer), got
        assert got.choices[0].message.content == r.text  # greedy both ways: the same tokens
    finally:
        assert d.stop() == 0, d.log()
