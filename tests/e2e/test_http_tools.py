"""Tools on the OpenAI door, through a real daemon and the real ``openai`` SDK.

The daemon serves a scripted model (``tests.helpers.agent_model``): its greedy answer thinks, then
calls ``get_weather`` in the Qwen/Hermes format that mlx-lm's ``json_tools`` parser reads; a
``logit_bias`` of -100 on ``<tool_call>`` makes it answer in text instead. So the whole and streamed
shapes, the agent loop's second turn (the call and its result rendered through the template), and
the bad inputs are all checked against a known answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import TEST_CONTEXT, Daemon
from tests.e2e.test_http import http_url
from tests.helpers import agent_model as script
from tests.helpers.daemons import serve_http, served

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve(path: Path, workdir: Path) -> Daemon:
    return serve_http(path, workdir, "--context-length", str(TEST_CONTEXT))


@pytest.fixture(scope="module")
def daemon(agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from served(serve(agent_model, tmp_path_factory.mktemp("http-tools")))


def no_call(agent_tokenizer: Any) -> dict[str, int]:
    """The bias that makes the script answer in text: ``<tool_call>`` never sampled."""
    return {str(agent_tokenizer.convert_tokens_to_ids(script.CALL)): -100}


def test_a_call_comes_back_as_tool_calls_with_the_reasoning_apart(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="agent", messages=ASK, tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert (choice.message.model_extra or {}).get("reasoning_content") == script.REASON
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == script.CALL_NAME
    assert json.loads(call.function.arguments) == script.CALL_ARGUMENTS


def test_a_streamed_call_accumulates_to_the_whole_answer(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model="agent", messages=ASK, tools=TOOLS, temperature=0).choices[0]
    calls: dict[int, dict[str, str]] = {}
    content, reasoning, finish, firsts = "", "", None, []
    for chunk in oai.chat.completions.create(model="agent", messages=ASK, tools=TOOLS, temperature=0, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # a call's first delta names it
                firsts.append(tc)
                calls[tc.index] = {"id": tc.id or "", "name": "", "arguments": ""}
            assert tc.function is not None
            calls[tc.index]["name"] += tc.function.name or ""
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert [(f.index, f.type, f.id is not None) for f in firsts] == [(0, "function", True)]
    assert finish == whole.finish_reason == "tool_calls"
    assert (content, reasoning) == ("", script.REASON)
    (w,) = whole.message.tool_calls or []
    assert calls[0]["name"] == w.function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(w.function.arguments) == script.CALL_ARGUMENTS
    assert calls[0]["id"].startswith("call_")


def test_tool_choice_none_leaves_the_answer_text(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="agent", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == script.CALL + script.CALL_A + script.CALL_B + script.CALL_C + script.CALL_END


def test_the_agent_loops_second_turn_renders_the_call_and_its_result(oai: openai.OpenAI, agent_tokenizer: Any) -> None:
    first = oai.chat.completions.create(model="agent", messages=ASK, tools=TOOLS, temperature=0).choices[0].message
    (call,) = first.tool_calls or []
    turn: Any = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r = oai.chat.completions.create(
        model="agent", messages=turn, tools=TOOLS, temperature=0, logit_bias=no_call(agent_tokenizer)
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == script.ANSWER and not r.choices[0].message.tool_calls
    rendered = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{**call.model_dump(), "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    ids = agent_tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True)
    assert "sunny, 21 C" in agent_tokenizer.decode(ids) and '"city": "Paris"' in agent_tokenizer.decode(ids)
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "agent", "messages": ASK, **body}, timeout=60)


#: Tools whose schemas leave a forced answer one choice per step, so a greedy model ends its call.
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Lyon"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def follows_schema(name: str, arguments: str) -> bool:
    """Whether a call's arguments parse against its tool's schema (an enum per required key)."""
    schema = next(t["function"]["parameters"] for t in (WEATHER, TIME) if t["function"]["name"] == name)
    args = json.loads(arguments)
    props = schema["properties"]
    return set(args) == set(schema["required"]) and all(args[k] in props[k]["enum"] for k in args)


def forced_calls(oai: openai.OpenAI, agent_tokenizer: Any, stream: bool, **kwargs: Any) -> tuple[str | None, list[Any]]:
    """The finish reason and ``(name, arguments)`` of each call of a text-biased answer, whole or
    streamed (deltas accumulated by index)."""
    args: Any = {"model": "agent", "messages": ASK, "temperature": 0, "logit_bias": no_call(agent_tokenizer), **kwargs}
    if not stream:
        choice = oai.chat.completions.create(**args).choices[0]
        assert choice.message.content is None
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.finish_reason, calls
    acc: dict[int, list[str]] = {}
    finish, content = None, ""
    for chunk in oai.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = acc.setdefault(tc.index, ["", ""])
            entry[0] += (tc.function.name or "") if tc.function else ""
            entry[1] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == ""
    return finish, [tuple(acc[i]) for i in sorted(acc)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_forces_that_call(oai: openai.OpenAI, agent_tokenizer: Any, stream: bool) -> None:
    bias = no_call(agent_tokenizer)
    text = oai.chat.completions.create(
        model="agent", messages=ASK, tools=[WEATHER, TIME], temperature=0, logit_bias=bias
    ).choices[0]
    assert text.finish_reason == "stop" and text.message.content == script.ANSWER  # unforced: text
    choice = {"type": "function", "function": {"name": "get_weather"}}
    finish, calls = forced_calls(oai, agent_tokenizer, stream, tools=[WEATHER, TIME], tool_choice=choice)
    assert finish == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather"]
    assert follows_schema(*calls[0]), calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_forces_a_call_to_a_given_tool(
    oai: openai.OpenAI, agent_tokenizer: Any, stream: bool
) -> None:
    finish, calls = forced_calls(oai, agent_tokenizer, stream, tools=[TIME], tool_choice="required")
    assert finish == "tool_calls"
    assert calls and all(name == "get_time" and follows_schema(name, a) for name, a in calls), calls


def test_a_family_the_grammar_cannot_write_keeps_the_400(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = script.write_agent_model(tmp_path_factory.mktemp("models") / "pythonic", tool_parser="pythonic")
    d = serve(path, tmp_path_factory.mktemp("pythonic"))
    try:
        body = {"messages": ASK, "tools": [TIME], "tool_choice": "required", "max_tokens": 8}
        r = httpx.post(f"{http_url(d)}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("tool_choice", "unsupported_parameter")
        assert "'tool_choice' requiring a call" in err["message"] and "pythonic" in err["message"]
    finally:
        assert d.stop() == 0, d.log()


NAMELESS = [{"type": "function", "function": {"description": "no name", "parameters": {}}}]
CALLED: Any = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]}


@pytest.mark.parametrize(
    ("body", "param", "code", "words"),
    [
        ({"tools": NAMELESS}, "tools", "bad_field", "tools[0].function.name is required"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice",
            "bad_field",
            "'get_time', which 'tools' does not define",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "bad_field",
            "cannot be combined with 'response_format'",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "x": {"$ref": 1},
                                "properties": {"a": {"$ref": "#/nowhere"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "bad_field",
            "cannot compile",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "bad_field", "'tool_choice' must be"),
        ({"tools": TOOLS * 2}, "tools", "bad_field", "twice"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages", "bad_field", "messages[1].tool_call_id"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        **CALLED,
                        "tool_calls": [{**CALLED["tool_calls"][0], "function": {"name": "f", "arguments": "{oops"}}],
                    },
                ]
            },
            "messages",
            "bad_field",
            "messages[1].tool_calls[0].function.arguments is not valid JSON",
        ),  # fmt: skip
        (
            {
                "messages": [
                    *ASK,
                    {
                        **CALLED,
                        "tool_calls": [
                            {
                                **CALLED["tool_calls"][0],
                                "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000},
                            }
                        ],
                    },
                ]
            },
            "messages",
            "bad_field",
            "messages[1].tool_calls[0].function.arguments is not valid JSON",
        ),  # fmt: skip
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter", "deprecated"),
    ],
    ids=[
        "nameless",
        "named-not-in-tools",
        "forced-and-response-format",
        "uncompilable-schema",
        "unknown-choice",
        "duplicate",
        "tool-message",
        "arguments",
        "deep-arguments",
        "functions",
    ],  # fmt: skip
)
def test_bad_tool_input_is_a_400_naming_the_field(
    url: str, body: dict[str, Any], param: str, code: str, words: str
) -> None:
    r = post(url, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code)
    assert words in err["message"]
    assert post(url, {"tools": TOOLS, "temperature": 0}).json()["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("kind", ["no-parser", "template-without-tools"])
def test_tools_on_a_model_that_cannot_call_them_is_one_400(kind: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("models") / kind
    if kind == "no-parser":
        script.write_agent_model(path, template=script.PLAIN_TEMPLATE, tool_parser=None)
    else:
        script.write_agent_model(path, template=script.PLAIN_TEMPLATE)
    d = serve(path, tmp_path_factory.mktemp(kind))
    try:
        url = http_url(d)
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("tools", "no_tool_support")
        why = "no tool-call parser" if kind == "no-parser" else "does not render tools"
        assert why in err["message"]
        ok = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        assert d.stop() == 0, d.log()
