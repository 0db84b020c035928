"""Structured output over the OpenAI door (demo model), with the real ``openai`` SDK:
``chat.completions.parse`` with a pydantic model, ``response_format`` json_schema and json_object on
chat and completions, whole and streamed, the same tokens as the ZeroMQ client gets for the same
request; a schema the engine cannot compile is a 400 naming ``response_format``, and the daemon
serves on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from clients import Client
from tests.conftest import Daemon
from tests.helpers.daemons import serve_http, served


class City(BaseModel):
    name: str = Field(max_length=16)
    population: int = Field(ge=0, le=10**9)
    capital: bool


def strict(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema() | {"additionalProperties": False}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from served(serve_http("demo", tmp_path_factory.mktemp("http-structured")))


CHAT = [{"role": "user", "content": "Name a city."}]


def test_parse_with_a_pydantic_model(oai: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        got = oai.chat.completions.parse(
            model="demo", messages=CHAT, response_format=City, max_tokens=80, temperature=temperature, seed=5
        )
        choice = got.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, City), choice.message.content


def test_json_schema_whole_and_streamed_equal_the_zmq_client(oai: openai.OpenAI, daemon: Daemon) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": strict(City), "strict": True}}
    whole = oai.chat.completions.create(model="demo", messages=CHAT, response_format=fmt, max_tokens=80)
    text = whole.choices[0].message.content or ""
    City.model_validate_json(text)
    chunks = oai.chat.completions.create(model="demo", messages=CHAT, response_format=fmt, max_tokens=80, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    with Client(daemon.address, timeout=120) as c:
        r = c.generate(messages=CHAT, max_tokens=80, response_format={"type": "json_schema", "schema": strict(City)})
    assert r.text == text


def test_completions_json_object(oai: openai.OpenAI) -> None:
    got = oai.completions.create(
        model="demo", prompt="A JSON object:", max_tokens=120, extra_body={"response_format": {"type": "json_object"}}
    )
    assert got.choices[0].finish_reason == "stop" and isinstance(json.loads(got.choices[0].text), dict), got


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        {"type": "json_schema", "json_schema": "x"},
        {"type": "xml"},
    ],
    ids=["bad-required", "bad-type", "not-an-object", "unknown-kind"],
)
def test_a_bad_schema_is_a_400_naming_response_format(url: str, oai: openai.OpenAI, fmt: dict[str, Any]) -> None:
    for path, body in (("chat/completions", {"messages": CHAT}), ("completions", {"prompt": "a"})):
        r = httpx.post(f"{url}/v1/{path}", json={**body, "max_tokens": 8, "response_format": fmt}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format" and err["code"] == "bad_field", err
        assert "response_format" in err["message"], err
    ok = oai.chat.completions.create(model="demo", messages=CHAT, max_tokens=4)  # nothing else disturbed
    assert ok.choices[0].finish_reason == "length"
