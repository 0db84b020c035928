"""The wire's tool fields: every ``tool_choice`` survives the client's map and the daemon's parse
unchanged, and each refusal names the field to fix."""

from __future__ import annotations

from typing import Any

import pytest

from clients.messages import submit_message
from clients.parse import parse_request
from clients.protocol import Submit
from clients.tools import MAX_TOOLS, ToolError, parse_tools

FN: Any = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
G: Any = {"type": "function", "function": {"name": "g", "description": "", "parameters": {}}}


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        (None, None),
        ("none", None),
        ("required", False),
        ("required", None),
        ({"type": "function", "function": {"name": "g"}}, None),
    ],
)
def test_tools_cross_the_wire_unchanged(choice: Any, parallel: Any) -> None:
    tools = parse_tools([FN, G], choice, parallel)
    assert tools is not None
    back = parse_request(submit_message(Submit(id="r", prompt="hi", tools=tools)))
    assert isinstance(back, Submit) and back.tools == tools


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param"),
    [
        ([{"type": "function", "function": {"parameters": {}}}], None, None, "tools"),
        ("f", None, None, "tools"),
        ([FN] * (MAX_TOOLS + 1), None, None, "tools"),
        ([FN, FN], None, None, "tools"),
        ([FN], {"type": "function", "function": {"name": "g"}}, None, "tool_choice"),
        ([FN], None, "yes", "parallel_tool_calls"),
    ],
    ids=["nameless", "not-a-list", "too-many", "twice", "named-not-in-tools", "parallel"],
)
def test_a_refusal_names_its_field(tools: Any, choice: Any, parallel: Any, param: str) -> None:
    with pytest.raises(ToolError) as info:
        parse_request({"v": 1, "type": "submit", "id": "r", "prompt": "hi", "tools": tools, "tool_choice": choice,
                       "parallel_tool_calls": parallel})  # fmt: skip
    assert (info.value.code, info.value.param, info.value.request_id) == ("bad_field", param, "r")
