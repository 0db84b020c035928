"""Anthropic tool use on ``/v1/messages``: ``tools``, ``tool_choice`` and the content blocks of a chat.

Anthropic's tools (``name``, ``description``, ``input_schema``) become the function tools the chat
template renders; an assistant turn's ``tool_use`` blocks become its ``tool_calls`` and a user turn's
``tool_result`` blocks become ``tool`` messages ahead of its text, as the OpenAI door sends them to
the template (``scheduler.tool_calls``). An assistant turn's thinking blocks are left out, as chat
templates leave out earlier reasoning. ``tool_choice`` ``any`` or a named tool is enforced
by the grammar engine (``scheduler.tool_grammar``).
"""

from __future__ import annotations

import json
from typing import Any

from scheduler.http_errors import unsupported
from scheduler.tool_calls import Tools, bad, check_function, text_of

_CHOICES = ("auto", "none", "any", "tool")


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """A body's ``tools`` and ``tool_choice``; ``None`` without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) and choice.get("type") in _CHOICES):
        raise bad(f"'tool_choice' must be an object whose 'type' is one of {list(_CHOICES)}", "tool_choice")
    kind = choice["type"] if choice is not None else "auto"
    parallel = choice.get("disable_parallel_tool_use") if choice is not None else None
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("'tool_choice.disable_parallel_tool_use' must be a boolean", "tool_choice")
    if tools is None or tools == []:
        if kind in ("any", "tool"):
            raise bad(f"'tool_choice' {kind!r} needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of tools", "tools")
    defs: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
            raise unsupported("tools", f"{where} is a server tool ({str(tool['type'])[:40]!r}); only custom tools are")
        if isinstance(tool, dict) and not isinstance(tool.get("input_schema"), dict):
            raise bad(f"{where}.input_schema is required: a JSON schema object", "tools")
        fn = check_function(
            {**tool, "parameters": tool.get("input_schema")} if isinstance(tool, dict) else tool, where, "tools"
        )
        defs.append({"type": "function", "function": fn})
    names = [d["function"]["name"] for d in defs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad(f"'tools' defines the tool {dup!r} twice", "tools")
    if kind == "any":
        return Tools(defs, parallel=parallel is not True, forced=True)
    if kind == "tool":
        name = choice.get("name") if choice is not None else None
        if not isinstance(name, str) or not name:
            raise bad("'tool_choice.name' is required: a non-empty string", "tool_choice")
        if name not in names:
            raise bad(f"'tool_choice' names the tool {name[:40]!r}, which 'tools' does not define", "tool_choice")
        return Tools(defs, parallel=False, forced=True, name=name)
    return Tools(defs, parse=kind == "auto", parallel=parallel is not True)


def _blocks(value: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise bad(f"{where} must be a string or a list of content blocks", "messages")
    for i, block in enumerate(value):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad(f"{where}[{i}] must be a content block with a 'type'", "messages")
    return value


def convert_messages(value: Any) -> list[dict[str, Any]]:
    """Anthropic messages as the chat template takes them (see the module's docstring)."""
    if not isinstance(value, list):
        raise bad("'messages' must be a list", "messages")
    if not value:
        raise bad("'messages' must hold at least one message", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where} must be an object whose 'role' is 'user' or 'assistant'", "messages")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(_blocks(m.get("content"), f"{where}.content")):
            at, kind = f"{where}.content[{j}]", block["type"]
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise bad(f"{at}.text must be a string", "messages")
                texts.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append(_call(block, at))
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue  # earlier thinking, sent back as Anthropic asks: templates drop it too
            elif kind == "tool_result" and m["role"] == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str) or not call_id:
                    raise bad(f"{at}.tool_use_id is required: the id of the tool_use this answers", "messages")
                text = text_of(block.get("content"), at, "text blocks")
                if block.get("is_error") is True:
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            else:
                raise unsupported("messages", f"block {kind[:40]!r} in {at} is not supported in a {m['role']} turn")
        msg: dict[str, Any] = {"role": m["role"], "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if texts or calls or not out or out[-1]["role"] != "tool":
            out.append(msg)
    return out


def _call(block: dict[str, Any], at: str) -> dict[str, Any]:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input")
    if not isinstance(name, str) or not name:
        raise bad(f"{at}.name is required: a non-empty string", "messages")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{at}.id is required: a non-empty string", "messages")
    if not isinstance(args, dict):
        raise bad(f"{at}.input must be an object", "messages")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed call (``tool_calls.parse_call``) as a ``tool_use`` block."""
    try:
        args = json.loads(call["arguments"])
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": call["name"], "input": args if isinstance(args, dict) else {}}


def wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The messages as the wire checks them: their string fields only."""
    return [{k: v for k, v in m.items() if isinstance(v, str)} for m in messages]
