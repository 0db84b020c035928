"""``tool_choice`` ``required`` or a named function (Anthropic: ``any`` or a named tool), enforced by
the grammar engine: the request's tools become an llguidance Lark grammar the answer must follow,
submitted as the request's ``response_format`` grammar (``workers.api.grammar``).

The family must be one whose calls the project can write as a grammar: the JSON family of
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (mlx-lm's ``json_tools`` parser, the
Qwen-style format). Each call's ``name`` is one of the allowed tools and its ``arguments`` follow
that tool's JSON schema (``%json`` inside Lark). A model that thinks may write its think block
first (opened by the answer, or already open in the prompt); the calls follow it. Any other family
is a 400 naming ``tool_choice``.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

from clients.protocol import ErrorCode, Submit
from clients.tools import ToolError
from scheduler import response_format
from scheduler.http_errors import HTTPError
from workers.api.grammar import JSON_OPTIONS

_START, _END = "<tool_call>", "</tool_call>"
#: The parser modules whose format is the JSON family above.
_JSON_PARSERS = ("json_tools",)


def why_not(tokenizer: Any) -> str:
    """Why the model's tool-call format cannot be written as a grammar ("" when it can)."""
    parser = getattr(tokenizer, "tool_parser", None)
    module = str(getattr(parser, "__module__", "") or "").rsplit(".", 1)[-1]
    start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
    if module in _JSON_PARSERS and start == _START and end == _END:
        return ""
    return f"its tool-call format ({module or 'unknown'!r}) cannot be enforced by the grammar engine"


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters") or {}
    args = params if params.get("type", "object") == "object" and params else {"type": "object"}
    return {
        "x-guidance": {**JSON_OPTIONS, "lenient": False},
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": args},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def marker(tokenizer: Any, text: str) -> str:
    """A marker as Lark matches it: its text, or the token it is one of in the vocabulary (the
    grammar engine reads an added token as special, never as its spelling)."""
    literal = json.dumps(text)
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
    if len(ids) == 1 and ">" not in text[:-1]:
        return f"({literal} | <[{ids[0]}]>)"
    return literal


def _think_close(tokenizer: Any) -> str:
    """What ends the think block after its text: the end marker's token, or nothing more where the
    text's own lexeme includes the marker (see ``grammar``)."""
    ids = tokenizer.encode(tokenizer.think_end, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else ""


def grammar(tokenizer: Any, tools: list[dict[str, Any]], name: str | None, many: bool, opens: bool) -> str:
    """The Lark grammar of a forced answer: one call to ``name`` (or, without it, one call, or one
    or more when ``many``, to any of ``tools``), after an optional think block where the tokenizer
    has thinking markers (``opens``: the prompt left it open, so the answer starts inside it)."""
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    lines = [f"fn{i}: %json {json.dumps(_call_schema(fn), ensure_ascii=False)}" for i, fn in enumerate(fns)]
    calls = "call (sep call)*" if many and name is None else "call"
    thinks = bool(getattr(tokenizer, "has_thinking", False))
    head = "sep?"
    if thinks:
        start, close = marker(tokenizer, tokenizer.think_start), _think_close(tokenizer)
        head = f"think_text {close} sep?" if opens else f"({start} think_text {close} sep?)?"
    rules = [
        f"start: {head} {calls}",
        f'call: {marker(tokenizer, _START)} "\\n" ({" | ".join(f"fn{i}" for i in range(len(fns)))}) "\\n"'
        f" {marker(tokenizer, _END)}",
        'sep: "\\n" | "\\n\\n"',
    ]
    if thinks:
        end = tokenizer.think_end
        one = len(tokenizer.encode(end, add_special_tokens=False)) == 1
        # An end marker that is one token is special to the engine: free text runs until it. One
        # written in several tokens ends the shortest text that reaches it.
        text = "/(?s:.*)/" if one else "/(?s:.*)" + re.escape(end).replace("/", "\\/") + "/"
        rules.append(f"think_text{'' if one else '[lazy]'}: {text}")
    return "\n".join(rules + lines) + "\n"


def forced(
    submit: Submit, tokenizer: Any, model: str, tools: Any, opens: bool, vocab_size: int, param: str = "tool_choice"
) -> Submit:
    """``submit`` with the grammar of its forced ``tool_choice`` as its response format; unchanged
    when the choice is not forced. A family the grammar cannot express is ``unsupported_parameter``
    naming ``param``; a request that already has a ``response_format`` or ``min_tokens``,
    ``bad_field`` naming ``param``; a tool schema the engine cannot compile, ``bad_field`` naming
    ``tools`` (each a ``ToolError``). May take milliseconds (the compile): the caller runs it off
    the event loop."""
    if tools is None or not tools.forced:
        return submit
    rid = submit.id
    why = why_not(tokenizer)
    if why:
        raise ToolError(
            f"'{param}' {tools.forced_shown} needs constrained decoding, and model {model!r} cannot: it {why}",
            param,
            rid,
            ErrorCode.UNSUPPORTED_PARAMETER,
        )
    for name, given in (
        ("response_format", submit.sampling.response_format),
        ("min_tokens", submit.sampling.min_tokens),
    ):
        if given:
            raise ToolError(f"'{param}' {tools.forced_shown} cannot be combined with '{name}'", param, rid)
    text = grammar(tokenizer, tools.tools, tools.name, tools.parallel, opens)
    failed = response_format.compile_failure("grammar", text, tokenizer, vocab_size)
    if failed is not None:
        first = failed.strip().splitlines()[0] if failed.strip() else "it does not compile"
        raise ToolError(f"'tools' has a schema the grammar engine cannot compile: {first[:300]}", "tools", rid)
    return replace(submit, sampling=replace(submit.sampling, response_format=("grammar", text)))


def enforce(
    submit: Submit, tokenizer: Any, model: str, tools: Any, opens: bool, vocab_size: int, param: str = "tool_choice"
) -> Submit:
    """``forced``, refused as the HTTP doors answer it (a 400 naming the field)."""
    try:
        return forced(submit, tokenizer, model, tools, opens, vocab_size, param)
    except ToolError as exc:
        raise HTTPError(400, exc.message, param=exc.param, code=exc.code.value) from None
