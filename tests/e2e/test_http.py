"""The OpenAI-compatible HTTP front door, through a real daemon, the real `openai` SDK and httpx.

Every answer is compared with what the ZeroMQ client gets from the same daemon for the same request:
the HTTP door is a second way into the same scheduler, so greedy output must be byte-identical.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clients import Client
from tests.conftest import TEST_CONTEXT, Daemon, start_daemon
from tests.reference import load_reference

MAX_FRAME = 65536
#: The tiny model's chat template, plus a variable only ``chat_template_kwargs`` can set.
TEMPLATE_WITH_VARIABLE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}{% if prefix is defined %}{{ prefix }}{% endif %}"
)


def http_url(daemon: Daemon) -> str:
    """The daemon's HTTP base URL, from its ready line (it binds port 0: a free port)."""
    found = re.search(r"OpenAI-compatible API at (http://\S+)/v1", daemon.log())
    assert found, daemon.log()
    return found.group(1)


def wait_until(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def chat_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-chat"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE_WITH_VARIABLE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def daemon(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(
        chat_model,
        tmp_path_factory.mktemp("http-daemon"),
        "--context-length",
        str(TEST_CONTEXT),
        "--max-tokens-cap",
        "370",
        "--default-max-tokens",
        "16",
        "--max-frame-bytes",
        str(MAX_FRAME),
        "--http",
        "127.0.0.1:0",
        "--http-body-timeout",
        "1",
    )
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def url(daemon: Daemon) -> str:
    return http_url(daemon)


@pytest.fixture()
def oai(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="ignored-without-tenants", max_retries=0) as c:
        yield c


@pytest.fixture()
def zmq_client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=120) as c:
        yield c


def test_models_and_health(oai: openai.OpenAI, url: str) -> None:
    assert [m.id for m in oai.models.list()] == ["tiny-chat"]
    assert oai.models.retrieve("tiny-chat").id == "tiny-chat"
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ready", "model": "tiny-chat"}


def test_completions_are_byte_identical_to_the_zeromq_client(oai: openai.OpenAI, zmq_client: Client) -> None:
    prompt = "def fibonacci(n):\n"
    want = zmq_client.generate(prompt, max_tokens=40)
    got = oai.completions.create(model="tiny-chat", prompt=prompt, max_tokens=40, temperature=0)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert got.choices[0].text == want.text and want.text
    assert got.choices[0].finish_reason == want.finish_reason == "length"
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        want.usage["prompt_tokens"],
        want.usage["completion_tokens"],
    )
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens

    tokens = [5, 80, 81, 82, 83]
    by_tokens = oai.completions.create(model="tiny-chat", prompt=tokens, max_tokens=12)
    assert by_tokens.choices[0].text == zmq_client.generate(tokens=tokens, max_tokens=12).text

    streamed = list(oai.completions.create(model="tiny-chat", prompt=prompt, max_tokens=40, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    assert streamed[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in streamed[:-1])


def test_chat_stream_and_whole_are_byte_identical_to_the_zeromq_client(oai: openai.OpenAI, zmq_client: Client) -> None:
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]
    want = zmq_client.generate(messages=messages, max_tokens=30)
    whole = oai.chat.completions.create(model="tiny-chat", messages=messages, max_completion_tokens=30)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text and want.text
    assert whole.choices[0].finish_reason == want.finish_reason
    assert whole.usage is not None and whole.usage.prompt_tokens == want.usage["prompt_tokens"]

    chunks = list(
        oai.chat.completions.create(
            model="tiny-chat",
            messages=messages,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-2].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == want.usage["completion_tokens"]
    assert all(c.usage is None for c in chunks[:-1])

    parts: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "Write "}, {"type": "text", "text": "a loop."}]}
    ]
    by_parts = oai.chat.completions.create(model="tiny-chat", messages=parts, max_tokens=30)
    assert by_parts.choices[0].message.content == zmq_client.generate(messages=messages[1:], max_tokens=30).text


def test_the_stream_is_server_sent_events_ending_in_done(url: str) -> None:
    body = {"model": "tiny-chat", "prompt": "import os\n", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e and not e.startswith(":")]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])
    assert json.loads(events[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"


def test_logprobs_stop_and_sampling_fields_match_the_zeromq_client(oai: openai.OpenAI, zmq_client: Client) -> None:
    prompt = "class Stack:\n"
    want = zmq_client.generate(prompt, max_tokens=20, logprobs=True)
    chat = oai.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": prompt}], max_tokens=20, logprobs=True
    )
    want_chat = zmq_client.generate(messages=[{"role": "user", "content": prompt}], max_tokens=20, logprobs=True)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    assert [e.logprob for e in chat.choices[0].logprobs.content] == want_chat.logprobs
    assert "".join(e.token for e in chat.choices[0].logprobs.content) == want_chat.text

    comp = oai.completions.create(model="tiny-chat", prompt=prompt, max_tokens=20, logprobs=0)
    assert comp.choices[0].logprobs is not None
    assert comp.choices[0].logprobs.token_logprobs == want.logprobs

    stop = want.text[6:8]
    stopped = oai.completions.create(model="tiny-chat", prompt=prompt, max_tokens=20, stop=[stop])
    assert stopped.choices[0].text == want.text[: want.text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    one = oai.completions.create(
        model="tiny-chat",
        prompt=prompt,
        max_tokens=20,
        temperature=0.9,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 40, "min_p": 0.01},
    )
    want_sampled = zmq_client.generate(
        prompt, max_tokens=20, temperature=0.9, top_p=0.9, seed=1234, top_k=40, min_p=0.01
    )
    assert one.choices[0].text == want_sampled.text


def test_top_logprobs_in_chat_and_completions_stream_and_whole(
    oai: openai.OpenAI, zmq_client: Client, chat_model: Path
) -> None:
    """OpenAI's two spellings, both shapes, against the ZeroMQ client's top logprobs for the same
    request (token texts each token decoded alone, as the HTTP layer documents)."""
    tokenizer = load_reference(str(chat_model))[1]

    def text(token: int) -> str:
        return str(tokenizer.decode([token]))

    messages: list[Any] = [{"role": "user", "content": "class Stack:\n"}]
    want = zmq_client.generate(messages=messages, max_tokens=20, top_logprobs=5)
    assert want.top_logprobs is not None and want.logprobs is not None and len(want.top_logprobs) == 20
    want_content = [
        (text(t), lp, [(text(a), alp) for a, alp in top])
        for t, lp, top in zip(want.tokens, want.logprobs, want.top_logprobs)
    ]
    whole = oai.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=20, logprobs=True, top_logprobs=5
    )
    streamed = oai.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=20, logprobs=True, top_logprobs=5, stream=True
    )
    stream_content = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content is not None
    for content in (whole.choices[0].logprobs.content, stream_content):
        got = [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in content]
        assert got == want_content
        for e in content:
            assert e.top_logprobs[0].token == e.token  # greedy: the emitted token is the likeliest
            assert all(a.bytes == list(a.token.encode("utf-8")) for a in e.top_logprobs)
    plain = oai.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=3, logprobs=True)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content is not None
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)

    prompt = "def fibonacci(n):\n"
    want = zmq_client.generate(prompt, max_tokens=16, top_logprobs=3)
    assert want.top_logprobs is not None
    maps = []
    for top in want.top_logprobs:
        m: dict[str, float] = {}
        for a, alp in top:
            m.setdefault(text(a), alp)
        maps.append(m)
    comp = oai.completions.create(model="tiny-chat", prompt=prompt, max_tokens=16, logprobs=3)
    assert comp.choices[0].logprobs is not None
    assert comp.choices[0].logprobs.top_logprobs == maps
    assert comp.choices[0].logprobs.token_logprobs == want.logprobs
    chunks = list(oai.completions.create(model="tiny-chat", prompt=prompt, max_tokens=16, logprobs=3, stream=True))
    assert [m for c in chunks if c.choices[0].logprobs for m in c.choices[0].logprobs.top_logprobs or []] == maps
    zero = oai.completions.create(model="tiny-chat", prompt=prompt, max_tokens=3, logprobs=0)
    assert zero.choices[0].logprobs is not None and zero.choices[0].logprobs.top_logprobs is None


def test_chat_template_kwargs_reach_the_template(oai: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    plain = oai.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2)
    prefixed = oai.chat.completions.create(
        model="tiny-chat",
        messages=messages,
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"prefix": "def "}},
    )
    assert plain.usage is not None and prefixed.usage is not None
    assert prefixed.usage.prompt_tokens == plain.usage.prompt_tokens + len("def ")  # a byte tokenizer
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(
            model="tiny-chat",
            messages=messages,
            extra_body={"chat_template_kwargs": {"tokenize": False}},
        )
    assert bad.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


def _error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    return err


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"prompt": "a", "n": 17}, "n"),
        ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 0}, "n"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        (
            "chat/completions",
            {
                "messages": [{"role": "user", "content": "a"}],
                "response_format": {"type": "json_schema", "json_schema": 1},
            },
            "response_format",
        ),
        ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": "2"},
            "top_logprobs",
        ),
        ("completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
        ("completions", {"prompt": "a", "logprobs": -1}, "logprobs"),
        ("completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
        ("completions", {"prompt": "a", "top_p": 0}, "top_p"),
        ("completions", {"prompt": 7}, "prompt"),
        ("completions", {"prompt": ""}, "prompt"),
        ("completions", {"prompt": "a", "max_tokens": 371}, "max_tokens"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        ("completions", {"prompt": "x" * (TEST_CONTEXT + 5)}, "prompt"),
        ("completions", {"prompt": [9999999]}, "prompt"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("chat/completions", {"messages": "hello"}, "messages"),
    ],
)
def test_bad_requests_are_400_naming_the_field(url: str, path: str, body: dict[str, Any], param: str) -> None:
    err = _error(httpx.post(f"{url}/v1/{path}", json={"model": "tiny-chat", **body}), 400, param)
    assert err["type"] == "invalid_request_error"


def test_malformed_unknown_and_oversized_requests(url: str, oai: openai.OpenAI) -> None:
    _error(httpx.post(f"{url}/v1/completions", content=b"{not json"), 400, None)
    _error(httpx.post(f"{url}/v1/completions", json=["a list"]), 400, None)
    assert (
        _error(httpx.post(f"{url}/v1/completions", json={"model": "gpt-4o", "prompt": "a"}), 404, "model")["code"]
        == "model_not_found"
    )
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4o", prompt="a")
    _error(httpx.get(f"{url}/v1/nowhere"), 404, None)
    big = {"model": "tiny-chat", "prompt": "a" * (MAX_FRAME + 1)}
    assert _error(httpx.post(f"{url}/v1/completions", json=big), 413, None)["code"] == "request_too_large"
    huge = {"model": "tiny-chat", "prompt": "a" * (5 * MAX_FRAME)}
    _error(httpx.post(f"{url}/v1/completions", json=huge), 413, None)
    # The daemon still answers after each of them.
    assert oai.completions.create(model="tiny-chat", prompt="a", max_tokens=2).choices[0].finish_reason


def test_a_body_that_never_finishes_gets_408(url: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = s.recv(4096)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 408"), reply


def test_a_client_leaving_mid_stream_cancels_its_request(url: str, zmq_client: Client) -> None:
    before = zmq_client.stats()["outcomes"].get("local", {}).get("disconnected", 0)
    generated = zmq_client.stats()["engine"]["generated_tokens"]
    body = {"model": "tiny-chat", "prompt": "a", "max_tokens": 370, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith("data: {")
    # Closed after the first chunk: the request ends `disconnected`, its slot is freed, and it
    # stops generating long before its 370 tokens.

    def settled() -> bool:
        s = zmq_client.stats()
        ended = s["outcomes"].get("local", {}).get("disconnected", 0) == before + 1
        return ended and s["requests_in_flight"] == 0 and s["engine"]["active_sequences"] == 0

    wait_until(settled, "the request ended disconnected and nothing is in flight")
    assert zmq_client.stats()["engine"]["generated_tokens"] - generated < 370


def test_http_requests_count_in_the_local_tenants_outcomes(oai: openai.OpenAI, zmq_client: Client) -> None:
    before = zmq_client.stats()["outcomes"].get("local", {})
    oai.completions.create(model="tiny-chat", prompt="a", max_tokens=3)
    after = zmq_client.stats()["outcomes"]["local"]
    assert after.get("length", 0) == before.get("length", 0) + 1


def test_a_lone_http_request_bursts_like_a_zeromq_one(chat_model: Path, tmp_path: Path) -> None:
    """Bursts, the probe gate and exactness apply to HTTP requests unchanged: a lone HTTP completion
    on a repetitive prompt runs burst rounds and is byte-identical to the ZeroMQ client's answer."""
    from tests.conftest import wait_for_verdict

    d = start_daemon(chat_model, tmp_path, "--draft", "prompt-lookup", "-k", "3", "--http", "127.0.0.1:0")
    try:
        prompt = [7, 7, 7, 7, 8, 8, 8, 8] * 3
        with Client(d.address, timeout=120) as c:
            assert wait_for_verdict(c)["level"] is not None  # the CPU's verdict lets bursts run
            expected = c.generate(tokens=prompt, max_tokens=40).tokens
            before = c.stats()["engine"]["bursts"]["rounds"]
            with openai.OpenAI(base_url=f"{http_url(d)}/v1", api_key="x", max_retries=0) as oai:
                out = oai.completions.create(model="tiny-chat", prompt=prompt, max_tokens=40, temperature=0)
            after = c.stats()["engine"]["bursts"]["rounds"]
            assert c.generate(tokens=prompt, max_tokens=40).tokens == expected
        assert out.usage is not None and out.usage.completion_tokens == len(expected)
        assert after > before, "the HTTP request ran no burst round"
        tokenizer = load_reference(str(chat_model))[1]
        assert out.choices[0].text == tokenizer.decode(expected)
    finally:
        assert d.stop() == 0, d.log()
