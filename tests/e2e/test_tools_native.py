"""Tools on the native protocol: ``tools`` and ``tool_choice`` through real ZeroMQ sockets, the client
library (sync and async) and a real daemon.

The daemon serves the scripted model of ``tests.helpers.agent_model`` (its greedy answer thinks, then
calls ``get_weather`` in the format mlx-lm's ``json_tools`` parser reads; a ``logit_bias`` of -100 on
``<tool_call>`` makes it answer in text), with the HTTP door on too: the wire's calls are parsed by
the same code as the door's, so both give the same calls for the same request. The text stays the
model's own (the call's markup included), so an agent sends it back as the assistant's turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
import zmq

from clients import AsyncClient, Client, TokenEvent, ToolCall
from clients.protocol import PROTOCOL_VERSION, pack, unpack
from clients.tools import ToolError
from tests.conftest import TEST_CONTEXT, Daemon, start_daemon
from tests.e2e.test_http_tools import ASK, TIME, TOOLS, WEATHER, follows_schema, no_call
from tests.helpers import agent_model as script
from tests.helpers.daemons import serve_http, served


@pytest.fixture(scope="module")
def daemon(agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = serve_http(agent_model, tmp_path_factory.mktemp("tools-native"), "--context-length", str(TEST_CONTEXT))
    yield from served(d)


CALL_TEXT = script.CALL + script.CALL_A + script.CALL_B + script.CALL_C + script.CALL_END


def raw_submit(address: str, body: dict[str, Any]) -> dict[str, Any]:
    """One submit map on a raw DEALER socket (past the client library's own checks), and the
    daemon's last answer to it (its ``end``)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    try:
        sock.send(pack({"v": PROTOCOL_VERSION, "type": "submit", "id": "t1", "messages": ASK, **body}))
        while True:
            assert sock.poll(60_000), "no answer"
            msg = unpack(sock.recv())
            if msg["type"] in ("end", "error"):
                return msg
    finally:
        sock.close(linger=0)


def door_calls(choice: Any) -> list[tuple[str, str]]:
    """The ``(name, arguments)`` of an OpenAI choice's function calls."""
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def test_a_call_comes_back_parsed_beside_the_text(client: Client, oai: openai.OpenAI) -> None:
    r = client.generate(messages=ASK, tools=TOOLS, max_tokens=32)
    assert r.finish_reason == "stop", r
    assert r.text == script.THINK + script.REASON + script.THINK_END + CALL_TEXT
    (call,) = r.tool_calls
    assert isinstance(call, ToolCall) and call.id.startswith("call_")
    assert call.name == script.CALL_NAME and json.loads(call.arguments) == script.CALL_ARGUMENTS
    door = oai.chat.completions.create(model="agent", messages=ASK, tools=TOOLS, temperature=0).choices[0]
    assert door_calls(door) == [(call.name, call.arguments)]  # the same parse


def test_a_prompt_rendered_by_the_client_gets_its_calls_read(client: Client, agent_tokenizer: Any) -> None:
    """``tokens`` (or ``prompt``) with ``tools``: the prompt is taken as it is, the calls still parsed."""
    ids = agent_tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True)
    by_ids = client.generate(tokens=ids, tools=TOOLS, max_tokens=32)
    by_messages = client.generate(messages=ASK, tools=TOOLS, max_tokens=32)
    assert by_ids.tokens == by_messages.tokens and by_ids.usage["prompt_tokens"] == len(ids)
    assert [(c.name, c.arguments) for c in by_ids.tool_calls] == [(c.name, c.arguments) for c in by_messages.tool_calls]
    assert len(by_ids.tool_calls) == 1


def test_without_tools_or_with_tool_choice_none_no_call_is_read(client: Client) -> None:
    plain = client.generate(messages=ASK, max_tokens=32)
    none = client.generate(messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=32)
    assert plain.tool_calls == [] and none.tool_calls == []
    assert CALL_TEXT in plain.text and CALL_TEXT in none.text


def test_the_stream_carries_the_call_on_the_event_that_closes_it(daemon: Daemon) -> None:
    async def main() -> list[TokenEvent]:
        async with AsyncClient(daemon.address, timeout=120) as c:
            return [e async for e in c.stream(messages=ASK, tools=TOOLS, max_tokens=32) if isinstance(e, TokenEvent)]

    events = anyio.run(main, backend="asyncio")
    with_calls = [i for i, e in enumerate(events) if e.tool_calls]
    assert len(with_calls) == 1, events
    i = with_calls[0]
    text_before = "".join(e.text for e in events[:i])
    assert script.CALL_END not in text_before and script.CALL_END in text_before + events[i].text
    (call,) = events[i].tool_calls or []
    assert call.name == script.CALL_NAME and json.loads(call.arguments) == script.CALL_ARGUMENTS


def test_the_agent_loops_second_turn_renders_the_tools_and_the_result(client: Client, agent_tokenizer: Any) -> None:
    first = client.generate(messages=ASK, tools=TOOLS, max_tokens=32)
    (call,) = first.tool_calls
    turn = [
        *ASK,
        {"role": "assistant", "content": first.text},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r = client.generate(messages=turn, tools=TOOLS, max_tokens=32, logit_bias=no_call(agent_tokenizer))
    thought = script.THINK + script.REASON + script.THINK_END
    assert (r.text, r.tool_calls, r.finish_reason) == (thought + script.ANSWER, [], "stop")
    ids = agent_tokenizer.apply_chat_template(turn, tools=TOOLS, add_generation_prompt=True)
    assert "sunny, 21 C" in agent_tokenizer.decode(ids) and "get_weather" in agent_tokenizer.decode(ids)
    assert r.usage["prompt_tokens"] == len(ids)  # the tools were rendered into the prompt


@pytest.mark.parametrize(
    ("choice", "tools", "names"),
    [
        ({"type": "function", "function": {"name": "get_weather"}}, [WEATHER, TIME], ["get_weather"]),
        ("required", [TIME], None),
    ],
    ids=["named", "required"],
)
def test_a_forced_tool_choice_makes_the_answer_a_call(
    client: Client, oai: openai.OpenAI, agent_tokenizer: Any, choice: Any, tools: Any, names: list[str] | None
) -> None:
    bias = no_call(agent_tokenizer)
    free = client.generate(messages=ASK, tools=tools, max_tokens=48, logit_bias=bias)
    assert free.tool_calls == [] and free.text.endswith(script.ANSWER)  # unforced, the bias makes it text
    r = client.generate(messages=ASK, tools=tools, tool_choice=choice, logit_bias=bias)
    assert r.finish_reason == "stop" and r.tool_calls, r
    assert all(follows_schema(c.name, c.arguments) for c in r.tool_calls), r.tool_calls
    if names is not None:
        assert [c.name for c in r.tool_calls] == names
    door = oai.chat.completions.create(
        model="agent", messages=ASK, tools=tools, tool_choice=choice, temperature=0, logit_bias=bias
    ).choices[0]
    assert door_calls(door) == [(c.name, c.arguments) for c in r.tool_calls]


NAMELESS = [{"type": "function", "function": {"description": "no name", "parameters": {}}}]


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ({"tools": NAMELESS}, "bad_field", "tools[0].function.name is required"),
        ({"tools": {"get_weather": {}}}, "bad_field", "'tools' must be a list"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "bad_field",
            "'get_time', which 'tools' does not define",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "bad_field", "'tool_choice' must be"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "bad_field",
            "cannot be combined with 'response_format'",
        ),
        ({"tool_choice": "required"}, "bad_field", "'tools' is empty"),
    ],
    ids=["nameless", "not-a-list", "named-not-in-tools", "unknown-choice", "forced-and-format", "no-tools"],
)
def test_bad_tool_input_is_one_end_with_a_stable_code(
    daemon: Daemon, client: Client, body: dict[str, Any], code: str, words: str
) -> None:
    end = raw_submit(daemon.address, body)
    assert end["type"] == "end" and end["finish_reason"] == "error", end
    assert end["error"]["code"] == code and words in end["error"]["message"], end
    assert "\n" not in end["error"]["message"]
    assert client.generate(messages=ASK, tools=TOOLS, max_tokens=32).tool_calls  # nothing else disturbed


def test_the_client_checks_the_tool_fields_itself(client: Client) -> None:
    with pytest.raises(ToolError, match="tools\\[0\\].function.name is required") as info:
        client.generate(messages=ASK, tools=NAMELESS)
    assert (info.value.code, info.value.param) == ("bad_field", "tools")
    with pytest.raises(ToolError, match="which 'tools' does not define"):
        client.generate(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_tools_for_a_family_without_a_parser_is_no_tool_support(tmp_path_factory: pytest.TempPathFactory) -> None:
    d = start_daemon("demo", tmp_path_factory.mktemp("tools-demo"))
    try:
        end = raw_submit(d.address, {"tools": TOOLS})
        assert end["type"] == "end" and end["error"]["code"] == "no_tool_support", end
        assert "no tool-call parser" in end["error"]["message"]
        with Client(d.address, timeout=120) as c:
            assert c.generate(messages=ASK, max_tokens=4).usage["completion_tokens"] >= 1
    finally:
        assert d.stop() == 0, d.log()
