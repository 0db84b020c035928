"""Anthropic tool use on ``/v1/messages``, through a real daemon and the real ``anthropic`` SDK.

The daemon serves the scripted model of ``tests.helpers.agent_model``: asked not to think (Anthropic's
default, ``enable_thinking`` false in its template), its greedy answer is one call of ``get_weather``
in the format mlx-lm's ``json_tools`` parser reads. The call comes back as a ``tool_use`` block,
whole and streamed (``input_json_delta``), and the next turn's ``tool_result`` is rendered through
the chat template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import Daemon
from tests.e2e.test_http_tools import serve
from tests.helpers import agent_model as script
from tests.helpers.daemons import served

TOOLS: Any = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from served(serve(agent_model, tmp_path_factory.mktemp("anthropic-tools")))


def test_a_call_is_a_tool_use_block_whole_and_streamed(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(
        model="agent", max_tokens=32, messages=ASK, tools=TOOLS, extra_body={"temperature": 0}
    )
    assert whole.stop_reason == "tool_use"
    (block,) = whole.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert (block.name, block.input) == (script.CALL_NAME, script.CALL_ARGUMENTS)
    with claude.messages.stream(
        model="agent", max_tokens=32, messages=ASK, tools=TOOLS, extra_body={"temperature": 0}
    ) as s:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
        final = s.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == [
        ("tool_use", block.name, block.input)
    ]


def test_the_next_turn_renders_the_tool_use_and_its_result(claude: anthropic.Anthropic, agent_model: Path) -> None:
    from workers.models.loading import load_tokenizer

    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny, 21 C"}]}
    turn: Any = [*ASK, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
    r = claude.messages.create(model="agent", max_tokens=32, messages=turn, tools=TOOLS, extra_body={"temperature": 0})
    assert r.stop_reason == "tool_use"
    rendered = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    functions = [
        {"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
        for t in TOOLS
    ]  # fmt: skip
    tokenizer = load_tokenizer(str(agent_model))
    ids = tokenizer.apply_chat_template(rendered, tools=functions, add_generation_prompt=True, enable_thinking=False)
    assert "sunny, 21 C" in tokenizer.decode(ids)
    assert r.usage.input_tokens == len(ids)


def test_thinking_enabled_comes_back_as_a_thinking_block_whole_and_streamed(claude: anthropic.Anthropic) -> None:
    ask: Any = {"model": "agent", "max_tokens": 32, "messages": ASK, "tools": TOOLS}
    ask["thinking"] = {"type": "enabled", "budget_tokens": 16}
    whole = claude.messages.create(**ask, extra_body={"temperature": 0})
    assert whole.stop_reason == "tool_use"
    assert [b.type for b in whole.content] == ["thinking", "tool_use"]
    assert getattr(whole.content[0], "thinking", None) == script.REASON
    with claude.messages.stream(**ask, extra_body={"temperature": 0}) as s:
        kinds = {getattr(getattr(e, "delta", None), "type", None) for e in s}
        final = s.get_final_message()
    assert {"thinking_delta", "input_json_delta"} <= kinds
    assert [(b.type, getattr(b, "thinking", None)) for b in final.content] == [
        ("thinking", script.REASON),
        ("tool_use", None),
    ]
    thought_back: Any = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in whole.content]}]
    thought_back.append(
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": whole.content[1].id, "content": "sunny"}]}  # type: ignore[union-attr]
    )
    again = claude.messages.create(**{**ask, "messages": thought_back}, extra_body={"temperature": 0})
    assert [b.type for b in again.content] == ["thinking", "tool_use"]


def test_tool_choice_none_answers_text(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(
        model="agent",
        max_tokens=32,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "none"},
        extra_body={"temperature": 0},
    )
    assert r.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in r.content] == [
        ("text", script.CALL + script.CALL_A + script.CALL_B + script.CALL_C + script.CALL_END)
    ]


#: A second tool, with a schema that leaves a greedy forced answer one choice per step.
TIME: Any = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("tools", "choice"),
    [([*TOOLS, TIME], {"type": "tool", "name": "get_time"}), ([TIME], {"type": "any"})],
    ids=["named", "any"],
)
def test_a_forced_tool_choice_calls_a_given_tool_not_the_models_own(
    claude: anthropic.Anthropic, tools: list[Any], choice: Any, stream: bool
) -> None:
    """The script calls ``get_weather`` on its own; forced to ``get_time``, it calls that, with
    arguments that follow its schema."""
    args: Any = {"model": "agent", "max_tokens": 89, "messages": ASK, "tools": tools, "tool_choice": choice}
    if stream:
        with claude.messages.stream(**args, extra_body={"temperature": 0}) as s:
            r = s.get_final_message()
    else:
        r = claude.messages.create(**args, extra_body={"temperature": 0})
    assert r.stop_reason == "tool_use", r.content
    uses = [b for b in r.content if b.type == "tool_use"]
    assert uses and all(b.name == "get_time" for b in uses), r.content
    assert all(b.input in ({"zone": "UTC"}, {"zone": "CET"}) for b in uses), r.content  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ({"tools": [{"input_schema": {}}]}, "bad_field", "tools[0].name is required"),
        ({"tools": [{"name": "f"}]}, "bad_field", "tools[0].input_schema is required"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"}}, "bad_field", "'get_time', which"),
        ({"thinking": {"type": "enabled"}}, "bad_field", "budget_tokens"),
        ({"thinking": {"type": "adaptive"}}, "unsupported_parameter", "thinking"),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": "x"},
                    {"role": "user", "content": [{"type": "tool_result", "content": "r"}]},
                ]
            },
            "bad_field",
            "messages[2].content[0].tool_use_id is required",
        ),  # fmt: skip
    ],
    ids=["nameless", "no-schema", "named-not-in-tools", "no-budget", "adaptive", "result-without-id"],
)
def test_bad_tool_input_is_a_400_naming_it(url: str, body: dict[str, Any], code: str, words: str) -> None:
    r = httpx.post(f"{url}/v1/messages", json={"max_tokens": 8, "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == code
    assert words in err["message"]
    ok = httpx.post(f"{url}/v1/messages", json={"max_tokens": 32, "messages": ASK, "tools": TOOLS}, timeout=60)
    assert json.loads(ok.text)["stop_reason"] == "tool_use"
