"""Reasoning on the OpenAI door, through a real daemon and the real ``openai`` SDK: where the
tokenizer has thinking markers, the thinking goes to ``reasoning_content`` (whole and streamed) and
never into ``content``; ``chat_template_kwargs`` still switch it off, or open the think block in the
prompt so the answer starts inside it.

The daemon serves the scripted model of ``tests.helpers.agent_model`` (it thinks, then calls a tool);
a ``logit_bias`` of -100 on ``<tool_call>`` makes it answer in text after thinking.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Daemon
from tests.e2e.test_http_tools import ASK, no_call, serve
from tests.helpers import agent_model as script
from tests.helpers.daemons import served


@pytest.fixture(scope="module")
def daemon(agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from served(serve(agent_model, tmp_path_factory.mktemp("http-reasoning")))


@pytest.fixture(scope="module")
def bias(agent_model: Path) -> dict[str, int]:
    from workers.models.loading import load_tokenizer

    return no_call(load_tokenizer(str(agent_model)))


def whole(oai: openai.OpenAI, bias: dict[str, int], **extra: Any) -> tuple[str | None, str | None]:
    r = oai.chat.completions.create(model="agent", messages=ASK, temperature=0, logit_bias=bias, **extra)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    return (msg.model_extra or {}).get("reasoning_content"), msg.content


def streamed(oai: openai.OpenAI, bias: dict[str, int], **extra: Any) -> list[tuple[str, str]]:
    """Per choice: the reasoning and the content its deltas add up to."""
    out: dict[int, tuple[str, str]] = {}
    for chunk in oai.chat.completions.create(
        model="agent", messages=ASK, temperature=0, logit_bias=bias, stream=True, **extra
    ):
        for c in chunk.choices:
            r, t = out.get(c.index, ("", ""))
            out[c.index] = (
                r + ((c.delta.model_extra or {}).get("reasoning_content") or ""),
                t + (c.delta.content or ""),
            )
    return [out[i] for i in sorted(out)]


def test_the_thinking_goes_to_reasoning_content_whole_and_streamed(oai: openai.OpenAI, bias: dict[str, int]) -> None:
    assert whole(oai, bias) == (script.REASON, script.ANSWER)
    assert streamed(oai, bias) == [(script.REASON, script.ANSWER)]
    assert streamed(oai, bias, n=2) == [(script.REASON, script.ANSWER)] * 2


def test_chat_template_kwargs_switch_thinking_off(oai: openai.OpenAI, bias: dict[str, int]) -> None:
    off = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    assert whole(oai, bias, **off) == (None, script.ANSWER)
    assert streamed(oai, bias, **off) == [("", script.ANSWER)]


def test_an_answer_that_starts_inside_the_prompts_think_block(oai: openai.OpenAI, bias: dict[str, int]) -> None:
    opened = {"extra_body": {"chat_template_kwargs": {"open_think": True}}}
    assert whole(oai, bias, **opened) == (script.REASON, script.ANSWER)
    assert streamed(oai, bias, **opened) == [(script.REASON, script.ANSWER)]


def test_completions_are_the_raw_text(url: str, bias: dict[str, int]) -> None:
    body = {"prompt": "<|user|>hi\n<|assistant|>", "temperature": 0, "logit_bias": bias}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["text"] == script.THINK + script.REASON + script.THINK_END + script.ANSWER
