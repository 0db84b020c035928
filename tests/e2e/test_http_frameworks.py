"""The OpenAI door as app frameworks use it: langchain-openai (``bind_tools``, ``with_structured_output``
both ways, an agent loop of two tool calls) and litellm (chat completion and streaming, with and
without tools), each against a real daemon.

The daemon serves the scripted model of ``tests.helpers.agent_model``: its greedy answer thinks, then
calls ``get_weather``; a ``logit_bias`` of -100 on ``<tool_call>`` makes it answer in text. So what
each framework gets back is known exactly. Nothing here reaches the network: litellm reads its
bundled model cost map (``LITELLM_LOCAL_MODEL_COST_MAP``), set before it is imported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from tests.conftest import Daemon
from tests.e2e.test_http_tools import ASK, TOOLS, no_call
from tests.helpers import agent_model as script
from tests.helpers.daemons import serve_http, served

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
#: Room for the agent loop's third prompt: the tool's schema, two calls and two results, in bytes.
CONTEXT = 1024


@pytest.fixture(scope="module")
def daemon(agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = serve_http(agent_model, tmp_path_factory.mktemp("http-frameworks"), "--context-length", str(CONTEXT))
    yield from served(d)


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Lyon"]
    unit: Literal["celsius", "fahrenheit"]


# --------------------------------------------------------------------------- langchain-openai


def chat_model(url: str, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    key = SecretStr("none")
    return ChatOpenAI(base_url=f"{url}/v1", api_key=key, model="agent", temperature=0, max_retries=0, **kwargs)


def test_langchain_bind_tools_gets_the_call(url: str) -> None:
    ai = chat_model(url).bind_tools(TOOLS).invoke(ASK)
    (call,) = ai.tool_calls
    assert (call["name"], call["args"]) == (script.CALL_NAME, script.CALL_ARGUMENTS)
    assert call["id"].startswith("call_") and not ai.invalid_tool_calls
    assert ai.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(url: str, agent_tokenizer: Any, method: str) -> None:
    """``json_schema`` decodes under the schema (``response_format``); ``function_calling`` forces a
    call of the schema's tool (a named ``tool_choice``), which the family's parser reads back."""
    llm = chat_model(url, logit_bias=no_call(agent_tokenizer) if method == "json_schema" else None)
    got = llm.with_structured_output(Weather, method=method, strict=True).invoke("What is the weather in Paris?")
    assert isinstance(got, Weather), got


def test_langchain_agent_loop_of_two_tool_calls(url: str, agent_tokenizer: Any) -> None:
    """A hand-rolled agent loop: each turn's calls run as langchain tools and their results go back
    as tool messages; the third turn (text-biased, as a model that has its answer) answers in text.
    The second and third prompts hold every earlier call and result, rendered by the template."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    ran: list[dict[str, Any]] = []

    @tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """The weather in a city."""
        ran.append({"city": city, "unit": unit})
        return f"sunny, 2{len(ran)} C"

    calling = chat_model(url).bind_tools([get_weather])
    answering = chat_model(url, logit_bias=no_call(agent_tokenizer)).bind_tools([get_weather])
    messages: list[Any] = [HumanMessage(ASK[0]["content"])]
    rendered: list[dict[str, Any]] = list(ASK)
    for _ in range(4):
        ai = (calling if len(ran) < 2 else answering).invoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            break
        prompt = agent_tokenizer.apply_chat_template(rendered, tools=[_schema(get_weather)], add_generation_prompt=True)
        assert ai.usage_metadata["input_tokens"] == len(prompt)
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                 for c in ai.tool_calls]  # fmt: skip
        rendered.append({"role": "assistant", "content": "", "tool_calls": calls})
        for call in ai.tool_calls:
            result = get_weather.invoke(call)
            assert isinstance(result, ToolMessage)
            messages.append(result)
            rendered.append({"role": "tool", "tool_call_id": call["id"], "content": result.content})
    assert ran == [{"city": "Paris", "unit": "celsius"}] * 2
    assert messages[-1].content == script.ANSWER and not messages[-1].tool_calls
    ids = agent_tokenizer.apply_chat_template(rendered, tools=[_schema(get_weather)], add_generation_prompt=True)
    assert "sunny, 21 C" in agent_tokenizer.decode(ids) and "sunny, 22 C" in agent_tokenizer.decode(ids)
    assert messages[-1].usage_metadata["input_tokens"] == len(ids)


def _schema(fn: Any) -> dict[str, Any]:
    """A langchain tool as the OpenAI function tool langchain sends."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return convert_to_openai_tool(fn)


# --------------------------------------------------------------------------- litellm


def completion(url: str, **kwargs: Any) -> Any:
    import litellm

    return litellm.completion(
        model="openai/agent", api_base=f"{url}/v1", api_key="none", messages=ASK, temperature=0, **kwargs
    )


def test_litellm_chat_completion(url: str, agent_tokenizer: Any) -> None:
    r = completion(url, logit_bias=no_call(agent_tokenizer))
    message = r.choices[0].message
    assert (message.content, r.choices[0].finish_reason) == (script.ANSWER, "stop")
    assert message.reasoning_content == script.REASON
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0


def test_litellm_streaming(url: str, agent_tokenizer: Any) -> None:
    chunks = list(completion(url, logit_bias=no_call(agent_tokenizer), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == script.ANSWER
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_litellm_tool_calls(url: str, stream: bool) -> None:
    r = completion(url, tools=TOOLS, stream=stream)
    if not stream:
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
        finish = r.choices[0].finish_reason
    else:
        acc: dict[int, list[str]] = {}
        finish = None
        for chunk in r:
            if not chunk.choices:
                continue
            for tc in chunk.choices[0].delta.tool_calls or []:
                entry = acc.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        calls = [(acc[i][0], acc[i][1]) for i in sorted(acc)]
    assert finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in calls] == [(script.CALL_NAME, script.CALL_ARGUMENTS)]
