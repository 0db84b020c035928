"""Anthropic's Messages API (`POST /v1/messages`) through a real daemon, the real `anthropic` SDK and httpx.

The daemon has tenants (API keys, one with a small token cap) like any HTTP door. Every answer is
compared with the OpenAI door's for the same chat on the same daemon (greedy output is byte-identical
across doors) and with the tokenizer's own count of the rendered prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import zmq.auth

from clients import Client
from scheduler.http_auth import key_digest, new_api_key
from tests.conftest import Daemon
from tests.e2e.test_http import http_url, wait_until
from tests.helpers.daemons import tenants_daemon

#: A chat (typed loosely: the two SDKs each name their own message types).
CHAT: Any = [{"role": "user", "content": "def fibonacci(n):"}]


def tenants_setup(d: Path) -> dict[str, str]:
    """A CURVE key for the daemon and the operator (``ops``, admin), and API keys for ``ops``,
    ``alice`` (at most 8 new tokens a request) and ``bob``, written into ``d / tenants.toml``."""
    for name in ("server", "ops"):
        zmq.auth.create_certificates(str(d), name)
    keys = {name: new_api_key() for name in ("ops", "alice", "bob")}
    text = ""
    for name, extra in (("ops", f'keys = ["{d / "ops.key"}"]\nadmin = true\n'), ("alice", "max_new_tokens = 8\n")):
        text += f'[tenants.{name}]\napi_keys_sha256 = ["{key_digest(keys[name])}"]\n{extra}'
    text += f'[tenants.bob]\napi_keys_sha256 = ["{key_digest(keys["bob"])}"]\n'
    (d / "tenants.toml").write_text(text)
    return keys


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dict[str, str]]]:
    d = tmp_path_factory.mktemp("anthropic")
    keys = tenants_setup(d)
    daemon = tenants_daemon("demo", d, d, "--max-tokens-cap", "200")
    yield daemon, keys
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module")
def url(setup: tuple[Daemon, dict[str, str]]) -> str:
    return http_url(setup[0])


@pytest.fixture()
def claude(url: str, setup: tuple[Daemon, dict[str, str]]) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key=setup[1]["bob"], max_retries=0) as c:
        yield c


@pytest.fixture()
def oai(url: str, setup: tuple[Daemon, dict[str, str]]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=setup[1]["bob"], max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from workers.models.loading import load_tokenizer

    return load_tokenizer("demo")


def openai_chat(oai: openai.OpenAI, messages: Any, max_tokens: int) -> tuple[str, str, int]:
    """The OpenAI door's greedy text, finish reason and completion tokens for the same chat."""
    got = oai.chat.completions.create(model="demo", messages=messages, max_tokens=max_tokens)
    assert got.usage is not None
    return got.choices[0].message.content or "", got.choices[0].finish_reason, got.usage.completion_tokens


def text_of(message: anthropic.types.Message) -> str:
    """The text of an answer's one content block (which must be text)."""
    assert len(message.content) == 1 and isinstance(message.content[0], anthropic.types.TextBlock), message
    return message.content[0].text


def sse_events(url: str, key: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of a streamed answer, as they came."""
    out: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("POST", f"{url}/v1/messages", json=body, headers={"x-api-key": key}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert name == data["type"]
                out.append((name, data))
    return out


def test_whole_and_streamed_messages_agree_with_the_openai_door(
    claude: anthropic.Anthropic, oai: openai.OpenAI, tokenizer: Any, url: str, setup: tuple[Daemon, dict[str, str]]
) -> None:
    text, finish, completion = openai_chat(oai, CHAT, 24)
    assert text
    prompt = len(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))

    got = claude.messages.create(
        model="demo", max_tokens=24, messages=CHAT, extra_body={"temperature": 0, "top_k": 1, "top_p": 1.0}
    )
    assert got.type == "message" and got.role == "assistant" and got.model == "demo"
    assert got.id.startswith("msg_")
    assert [b.type for b in got.content] == ["text"] and text_of(got) == text
    assert got.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish] and got.stop_sequence is None
    assert (got.usage.input_tokens, got.usage.output_tokens) == (prompt, completion)

    with claude.messages.stream(model="demo", max_tokens=24, messages=CHAT) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert text_of(final) == text and final.stop_reason == got.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt, completion)

    events = sse_events(url, setup[1]["bob"], {"max_tokens": 24, "messages": CHAT, "stream": True, "temperature": 0})
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * deltas + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["usage"] == {"input_tokens": prompt, "output_tokens": 0} and start["content"] == []
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == text
    assert all(d["delta"]["type"] == "text_delta" for n, d in events if n == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": got.stop_reason, "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": prompt, "output_tokens": completion}


def test_system_prompt_and_turns(claude: anthropic.Anthropic, oai: openai.OpenAI, tokenizer: Any) -> None:
    turns: Any = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]},
        {"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]},
    ]
    flat: Any = [
        {"role": "system", "content": "Be brief. Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Tell me a story"},
    ]
    text, _, completion = openai_chat(oai, flat, 20)
    as_string = claude.messages.create(
        model="demo",
        max_tokens=20,
        system="Be brief. Be kind.",
        messages=turns,
    )
    blocks: Any = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": " Be kind."}]
    as_blocks = claude.messages.create(model="demo", max_tokens=20, system=blocks, messages=turns)
    for got in (as_string, as_blocks):
        assert text_of(got) == text
        assert got.usage.input_tokens == len(tokenizer.apply_chat_template(flat, add_generation_prompt=True))
        assert got.usage.output_tokens == completion
    plain = claude.messages.create(model="demo", max_tokens=20, messages=turns)
    assert plain.usage.input_tokens < as_string.usage.input_tokens
    assert text_of(plain) != text, "the system prompt changes the answer"


def test_a_final_assistant_message_is_continued(
    claude: anthropic.Anthropic, oai: openai.OpenAI, tokenizer: Any
) -> None:
    """Anthropic's prefill: the answer continues the assistant's text, rendered without closing it."""
    chat: Any = [*CHAT, {"role": "assistant", "content": "    return"}]
    ids = list(tokenizer.apply_chat_template(chat, continue_final_message=True))
    assert tokenizer.decode(ids).endswith("# assistant:     return")
    want = oai.completions.create(model="demo", prompt=ids, max_tokens=12)
    got = claude.messages.create(model="demo", max_tokens=12, messages=chat)
    assert text_of(got) == want.choices[0].text and got.usage.input_tokens == len(ids)


def test_stop_sequences_and_max_tokens(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model="demo", max_tokens=40, messages=CHAT)
    text = text_of(whole)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 40, "the demo model ran 40 tokens"
    first = len(text) - len(text.lstrip())
    stop = text[first : first + 3]
    cut = text[: text.find(stop)]
    assert stop.strip() and len(cut) >= 5, text
    got = claude.messages.create(
        model="demo",
        max_tokens=40,
        messages=CHAT,
        stop_sequences=["never seen", stop],
    )
    assert (text_of(got), got.stop_reason, got.stop_sequence) == (cut, "stop_sequence", stop)
    assert got.usage.output_tokens < 40
    with claude.messages.stream(
        model="demo",
        max_tokens=40,
        messages=CHAT,
        stop_sequences=[stop],
    ) as stream:
        assert "".join(stream.text_stream) == cut
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)

    short = claude.messages.create(
        model="demo",
        max_tokens=3,
        messages=CHAT,
        stop_sequences=["never seen"],
    )
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 3)


def anthropic_error(r: httpx.Response, status: int, kind: str, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["code"] == code, body
    assert "\n" not in body["error"]["message"] and "Traceback" not in body["error"]["message"]
    return str(body["error"]["message"])


def test_a_wrong_or_missing_key_is_401_in_anthropic_shape(url: str) -> None:
    with anthropic.Anthropic(base_url=url, api_key="mlxb-wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            wrong.messages.create(model="demo", max_tokens=4, messages=CHAT)
    assert caught.value.status_code == 401
    body: Any = caught.value.body
    assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{url}/v1/messages", json={"max_tokens": 4, "messages": CHAT}, timeout=30)
    anthropic_error(r, 401, "authentication_error", "invalid_api_key")


@pytest.mark.parametrize(
    ("body", "code", "named"),
    [
        ({"messages": CHAT}, "missing_field", "max_tokens"),
        ({"max_tokens": 4, "messages": "hi"}, "bad_field", "messages"),
        ({"max_tokens": 4, "messages": {"role": "user", "content": "hi"}}, "bad_field", "messages"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "bad_field", "role"),
        ({"max_tokens": 4, "messages": []}, "bad_field", "messages"),
        ({"max_tokens": 0, "messages": CHAT}, "max_tokens_out_of_range", "max_tokens"),
        ({"max_tokens": 4, "messages": CHAT, "stop_sequences": "x"}, "bad_field", "stop_sequences"),
        ({"max_tokens": 4, "messages": CHAT, "temperature": "hot"}, "bad_field", "temperature"),
        ({"max_tokens": 4, "messages": CHAT, "system": 5}, "bad_field", "system"),
        ({"max_tokens": 4, "messages": CHAT, "frequency_penalty": 1}, "unknown_parameter", "frequency_penalty"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "unsupported_parameter",
            "image",
        ),
        (
            {"max_tokens": 4, "messages": CHAT, "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
            "no_tool_support",
            "cannot call tools: it has no tool-call parser",
        ),
        (
            {"max_tokens": 4, "messages": CHAT, "thinking": {"type": "enabled", "budget_tokens": 8}},
            "unsupported_parameter",
            "no thinking markers",
        ),
    ],
)
def test_bad_input_is_400_invalid_request_error(
    url: str, setup: tuple[Daemon, dict[str, str]], body: dict[str, Any], code: str, named: str
) -> None:
    key = setup[1]["bob"]
    r = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": key}, timeout=30)
    assert named in anthropic_error(r, 400, "invalid_request_error", code)
    ok = httpx.post(f"{url}/v1/messages", json={"max_tokens": 2, "messages": CHAT}, headers={"x-api-key": key})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= 2, ok.text


def test_tenants_limits_and_outcomes_are_the_openai_doors(url: str, setup: tuple[Daemon, dict[str, str]]) -> None:
    """alice may ask for at most 8 new tokens; her requests are hers in the per-tenant outcomes."""
    daemon, keys = setup
    with Client(daemon.address, timeout=60, **daemon.process.client_kwargs) as ops:
        before = dict(ops.stats()["outcomes"].get("alice", {}))
        bearer = {"authorization": f"Bearer {keys['alice']}"}
        r = httpx.post(f"{url}/v1/messages", json={"max_tokens": 9, "messages": CHAT}, headers=bearer, timeout=30)
        assert "8" in anthropic_error(r, 400, "invalid_request_error", "max_tokens_out_of_range")
        r = httpx.post(f"{url}/v1/messages", json={"max_tokens": 8, "messages": CHAT}, headers=bearer, timeout=30)
        assert r.status_code == 200, r.text
        after = dict(ops.stats()["outcomes"].get("alice", {}))
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    outcome = {"max_tokens": "length", "end_turn": "stop"}[r.json()["stop_reason"]]
    assert grew.get("max_tokens_out_of_range") == 1 and grew.get(outcome) == 1, grew

    # The same counts reach /metrics on the HTTP port (this daemon has no --metrics listener).
    sample = f'mlx_batchd_requests_total{{outcome="{outcome}",tenant="alice"}} {float(after[outcome])}'
    admin = {"authorization": f"Bearer {keys['ops']}"}
    wait_until(lambda: sample in httpx.get(f"{url}/metrics", headers=admin).text.splitlines(), sample)


def test_count_tokens_is_the_prompt_a_message_would_prefill(
    claude: anthropic.Anthropic, url: str, setup: tuple[Daemon, dict[str, str]], tokenizer: Any
) -> None:
    """``POST /v1/messages/count_tokens`` (the SDK's ``messages.count_tokens``): the rendered prompt's
    tokens, what ``/v1/messages`` reports as ``input_tokens`` for the same body; bad input and a
    missing key answered as on ``/v1/messages``."""
    turns: Any = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    turns.append({"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]})
    flat = [{"role": "system", "content": "Be brief."}, *turns[:2], {"role": "user", "content": "Tell me a story"}]
    counted = claude.messages.count_tokens(model="demo", system="Be brief.", messages=turns)
    assert counted.input_tokens == len(tokenizer.apply_chat_template(flat, add_generation_prompt=True))
    sent = claude.messages.create(model="demo", max_tokens=2, system="Be brief.", messages=turns)
    assert sent.usage.input_tokens == counted.input_tokens
    assert claude.messages.count_tokens(model="demo", messages=turns).input_tokens < counted.input_tokens

    key = {"x-api-key": setup[1]["bob"]}
    for body, code, named in [
        ({"messages": "hi"}, "bad_field", "messages"),
        ({"messages": CHAT, "max_tokens": 4}, "unknown_parameter", "max_tokens"),
        ({"messages": CHAT, "model": "other"}, "model_not_found", "other"),
    ]:
        r = httpx.post(f"{url}/v1/messages/count_tokens", json=body, headers=key, timeout=30)
        status, kind = (404, "not_found_error") if code == "model_not_found" else (400, "invalid_request_error")
        assert named in anthropic_error(r, status, kind, code)
    r = httpx.post(f"{url}/v1/messages/count_tokens", json={"messages": CHAT}, timeout=30)
    anthropic_error(r, 401, "authentication_error", "invalid_api_key")
