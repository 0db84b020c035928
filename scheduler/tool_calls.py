"""Tools on the native protocol and the HTTP doors: the request's ``tools`` and ``tool_choice``
(checked by ``clients.tools``, shared with the wire), tool messages for the chat template, the model
family's tool-call parser on the answer, and the render that puts them together (``prepare`` for a
wire request; the HTTP doors call the same parts).

The parts are mlx-lm's: the tokenizer wrapper names the family's markers (``tool_call_start``,
``tool_call_end``) and parser (``tool_parser``, from ``mlx_lm.tool_parsers``), and the chat template
renders the tool definitions (``apply_chat_template(..., tools=...)``), the assistant's earlier calls
and the tools' results. A model without a parser, or whose template ignores ``tools``, answers a
request with tools one refusal (``no_tool_support``: a 400 at the HTTP doors). ``tool_choice`` ``required`` or a named function
is enforced by the grammar engine (``scheduler.tool_grammar``) where the family's format can be
written as a grammar; elsewhere it is a 400 naming the value, never ignored.
"""

from __future__ import annotations

import json
import uuid
import weakref
from typing import Any

from clients import tools as tools_wire
from clients.protocol import ErrorCode, ProtocolError, Submit
from clients.tools import ToolError, Tools
from scheduler import response_format, tool_grammar
from scheduler.admission import prompt_ids
from scheduler.http_errors import HTTPError
from workers.api import ModelInfo

_SHOWN = 40
#: A message the probe renders with and without a tool, to tell whether a template renders tools.
_PROBE_MESSAGES = [{"role": "user", "content": "hi"}]
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "d", "parameters": {}}}
#: Per tokenizer: why it cannot take tools, or "" when it can.
_SUPPORT: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def bad(message: str, param: str) -> HTTPError:
    return HTTPError(400, message, param=param, code="bad_field")


def http_of(err: ToolError) -> HTTPError:
    """A refused tool field as the HTTP doors answer it: a 400 naming the field, with its code."""
    return HTTPError(400, err.message, param=err.param, code=err.code.value)


def check_function(fn: Any, where: str, param: str) -> dict[str, Any]:
    """One function definition (``clients.tools.check_function``), refused as an HTTP 400."""
    try:
        return tools_wire.check_function(fn, where, param)
    except ToolError as exc:
        raise http_of(exc) from None


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """An OpenAI body's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked as the wire
    checks them (``clients.tools.parse_tools``); ``None`` without tools."""
    try:
        return tools_wire.parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except ToolError as exc:
        raise http_of(exc) from None


def text_of(content: Any, where: str, parts: str = "text parts") -> str:
    """A message's ``content`` as one text: none, a string, or a list of ``{"type": "text"}`` parts
    (Anthropic calls them text blocks); anything else is a 400 naming ``where``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad(f"{where}.content must be a string or a list of {parts}", "messages")


def arguments_of(value: Any, where: str) -> dict[str, Any]:
    """A call's ``arguments`` (a JSON text, as OpenAI sends it) as the object templates render."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise bad(f"{where} must be a JSON object written as a string", "messages")
    try:
        parsed = json.loads(value) if value.strip() else {}
    except (ValueError, RecursionError) as exc:  # a JSON text nested past the parser's recursion
        raise bad(f"{where} is not valid JSON: {str(exc)[:80]}", "messages") from None
    if not isinstance(parsed, dict):
        raise bad(f"{where} must be a JSON object", "messages")
    return parsed


def template_message(m: dict[str, Any], where: str) -> dict[str, Any]:
    """An OpenAI ``tool`` message, or an assistant message with ``tool_calls``, as the chat template
    takes it (arguments as objects, as Hugging Face templates expect)."""
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad(f"{where}.tool_call_id is required: the id of the call this answers", "messages")
        out = {"role": "tool", "tool_call_id": call_id, "content": text_of(m.get("content"), where)}
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        return out
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list", "messages")
    rendered = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise bad(f"{at} must be an object with a 'function'", "messages")
        fn = call["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{at}.function.name is required: a non-empty string", "messages")
        args = arguments_of(fn.get("arguments"), f"{at}.function.arguments")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"{at}.id must be a string", "messages")
        rendered.append(
            {"id": call_id or new_call_id(), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return {"role": "assistant", "content": text_of(m.get("content"), where), "tool_calls": rendered}


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def support(tokenizer: Any) -> str:
    """Why ``tokenizer`` cannot take tools ("" when it can): no parser for its family, or a chat
    template that renders the same prompt with a tool as without (probed once per tokenizer)."""
    known = _SUPPORT.get(tokenizer)
    if known is not None:
        return known
    why = ""
    if getattr(tokenizer, "tool_parser", None) is None or not getattr(tokenizer, "tool_call_start", None):
        why = "has no tool-call parser (mlx-lm names none for its family)"
    else:
        try:
            plain = tokenizer.apply_chat_template(_PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
            with_tool = tokenizer.apply_chat_template(
                _PROBE_MESSAGES, add_generation_prompt=True, tokenize=False, tools=[_PROBE_TOOL]
            )
            if plain == with_tool:
                why = "has a chat template that does not render tools"
        except Exception as exc:  # a template that fails on a plain chat cannot take tools either
            why = f"has a chat template that fails with tools ({str(exc)[:80]})"
    _SUPPORT[tokenizer] = why
    return why


def support_error(tokenizer: Any, model: str, param: str = "tools", rid: str | None = None) -> ToolError | None:
    """The refusal of tools for a model that cannot take them (``no_tool_support``), or ``None``."""
    why = support(tokenizer)
    if not why:
        return None
    return ToolError(f"model {model!r} cannot call tools: it {why}", param, rid, ErrorCode.NO_TOOL_SUPPORT)


def require_support(tokenizer: Any, model: str, param: str = "tools") -> None:
    err = support_error(tokenizer, model, param)
    if err is not None:
        raise http_of(err)


def render(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **kwargs: Any
) -> list[int]:
    """The prompt's token ids: the messages, the tool definitions and the template variables."""
    if tools:
        kwargs["tools"] = tools
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))


def opens_thinking(tokenizer: Any, ids: list[int]) -> bool:
    """Whether the prompt leaves a think block open (its last start marker after its last end), so
    the answer starts in reasoning, as mlx-lm's server decides it."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    return bool(tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids))


def parse_call(
    tokenizer: Any, text: str, tools: list[dict[str, Any]] | None, prefix: str = "call_"
) -> list[dict[str, Any]] | None:
    """The calls in one tool-call text, as ``{"id", "name", "arguments"}`` with the arguments a JSON
    text; ``None`` when the family's parser cannot read it (the caller keeps it as text)."""
    try:
        parsed = tokenizer.tool_parser(text, tools)
    except Exception:  # a parser's errors are as many as its formats: a malformed call is text
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return None
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                json.loads(args)
            except (ValueError, RecursionError):
                args = json.dumps(args, ensure_ascii=False)
        else:
            args = json.dumps(args, ensure_ascii=False)
        out.append({"id": str(call.get("id") or new_call_id(prefix)), "name": call["name"], "arguments": args})
    return out


def renders_here(parsed: Any, tokenizer: Any) -> bool:
    """Whether the HTTP door renders a chat itself rather than the front end: template variables,
    tools or tool messages (the wire's messages carry text only), or a model that thinks (whether
    its answer starts in reasoning depends on the rendered prompt)."""
    rich = any(m.get("role") == "tool" or "tool_calls" in m for m in parsed.chat_messages)
    return bool(parsed.template_kwargs or parsed.tools or rich or getattr(tokenizer, "has_thinking", False))


def splits(parsed: Any, tokenizer: Any) -> bool:
    """Whether a chat answer goes through ``chat_reply.Answer``: calls to parse, or thinking to split."""
    return bool((parsed.tools is not None and parsed.tools.parse) or getattr(tokenizer, "has_thinking", False))


def prepare(req: Submit, tokenizer: Any, info: ModelInfo) -> tuple[Submit, list[int], bool]:
    """A wire request with ``tools`` ready for admission: the model's support checked, the prompt's
    ids (``messages`` rendered with the tool definitions; ``prompt`` and ``tokens`` as they are),
    whether the prompt leaves a think block open, and the request with its forced ``tool_choice``
    as a grammar (``tool_grammar.forced``). Raises ``ProtocolError`` (a ``ToolError`` for the
    tool fields). Blocking: the caller runs it off the event loop."""
    tools = req.tools
    assert tools is not None
    err = support_error(tokenizer, info.name, "tools", req.id)
    if err is not None:
        raise err
    if req.messages is not None and info.has_chat_template:
        response_format.check(req, tokenizer, info.vocab_size)
        try:
            ids = render(tokenizer, list(req.messages), tools.tools)
        except Exception as exc:  # jinja errors from a template that rejects these messages
            raise ProtocolError(ErrorCode.BAD_FIELD, f"the chat template rejected 'messages': {exc}", req.id) from None
    else:
        ids = prompt_ids(req, tokenizer, info)
    opens = opens_thinking(tokenizer, ids)
    return tool_grammar.forced(req, tokenizer, info.name, tools, opens, info.vocab_size), ids, opens
