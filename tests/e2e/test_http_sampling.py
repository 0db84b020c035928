"""Logits controls and ``n`` over the OpenAI door, with the real ``openai`` SDK: each control
answers exactly what the ZeroMQ client gets for the same request (vLLM's extra fields in
``extra_body`` included); ``n`` gives n choices whole and streamed; bad values are a 400 naming the
field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clients import Client
from tests.conftest import TEST_CONTEXT, Daemon
from tests.e2e.test_http import TEMPLATE_WITH_VARIABLE
from tests.helpers.daemons import serve_http, served

PROMPT = [7, 7, 7, 7, 8, 8, 8, 8]


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    path = tmp_path_factory.mktemp("models") / "tiny-chat"
    path.mkdir()
    for f in tiny_model.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE_WITH_VARIABLE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    yield from served(serve_http(path, tmp_path_factory.mktemp("http-sampling"), "--context-length", str(TEST_CONTEXT)))


@pytest.fixture(scope="module")
def zmq(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=120) as c:
        yield c


@pytest.mark.parametrize(
    ("sdk", "extra", "wire"),
    [
        ({"presence_penalty": 1.5}, {}, {"presence_penalty": 1.5}),
        ({"frequency_penalty": 0.7}, {}, {"frequency_penalty": 0.7}),
        ({"logit_bias": {"42": 100}}, {}, {"logit_bias": {42: 100.0}}),
        ({}, {"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
        ({}, {"min_tokens": 5, "logit_bias": {"0": 100}}, {"min_tokens": 5, "logit_bias": {0: 100.0}}),
        ({}, {"ignore_eos": True, "logit_bias": {"0": 100}}, {"ignore_eos": True, "logit_bias": {0: 100.0}}),
        ({}, {"top_k": 1, "min_p": 0.5, "seed": 3}, {"top_k": 1, "min_p": 0.5, "seed": 3}),
    ],
    ids=["presence", "frequency", "logit_bias", "repetition", "min_tokens", "ignore_eos", "top_k_min_p"],
)
def test_each_control_answers_what_the_zeromq_client_gets(
    oai: openai.OpenAI, zmq: Client, sdk: dict[str, Any], extra: dict[str, Any], wire: dict[str, Any]
) -> None:
    want = zmq.generate(tokens=PROMPT, max_tokens=20, **wire)
    plain = zmq.generate(tokens=PROMPT, max_tokens=20)
    if "top_k" not in wire:  # the rest change this greedy output
        assert want.tokens != plain.tokens
    got = oai.completions.create(
        model="tiny-chat", prompt=PROMPT, max_tokens=20, temperature=0, extra_body=extra or None, **sdk
    )
    assert got.choices[0].text == want.text
    assert got.usage is not None and got.usage.completion_tokens == len(want.tokens)
    assert got.choices[0].finish_reason == want.finish_reason


def test_n_gives_n_seeded_choices_whole_and_streamed(oai: openai.OpenAI, zmq: Client) -> None:
    messages: list[Any] = [{"role": "user", "content": "Say something."}]
    args: dict[str, Any] = {"model": "tiny-chat", "messages": messages, "max_tokens": 12, "temperature": 1.0}
    whole = oai.chat.completions.create(n=3, seed=5, **args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    singles = [oai.chat.completions.create(seed=5 + i, **args).choices[0].message.content for i in range(3)]
    assert texts == singles and len(set(texts)) > 1
    assert whole.usage is not None and whole.usage.completion_tokens == 36  # no EOS in 12 tokens here

    streamed = ["", "", ""]
    finished = set()
    usage = None
    for chunk in oai.chat.completions.create(n=3, seed=5, stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
    assert streamed == texts and finished == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
        ({"min_tokens": 30, "max_tokens": 10}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(url: str, body: dict[str, Any], param: str) -> None:
    for n in (1, 2):  # the n path answers the same
        if "n" in body and n == 2:
            continue
        full = {"model": "tiny-chat", "prompt": PROMPT, "max_tokens": 8, "n": n, **body}
        r = httpx.post(f"{url}/v1/completions", json=full, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "bad_field", err
