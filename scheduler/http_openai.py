"""OpenAI request bodies in, wire ``Submit`` out; errors in the OpenAI shape.

The body is translated into the wire protocol's submit map and checked by ``clients.parse``'s
own ``parse_request``, so an HTTP request is held to exactly the rules of a ZeroMQ one; what only
OpenAI has (``n``, ``tools``, ``response_format``, its two spellings of logprobs, ...) is checked
here (``n`` becomes ``n`` sequences, ``Parsed.submits``), and what the daemon cannot do yet is a 400
naming the field rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

from clients.parse import expand_n, parse_request
from clients.protocol import MAX_N, MAX_TOP_LOGPROBS, ErrorCode, MsgType, ProtocolError, Submit
from scheduler.http_errors import HTTPError, unsupported
from scheduler.response_format import from_openai
from scheduler.tool_calls import parse_tools, template_message

#: HTTP status and OpenAI error type per wire error code; anything else is a 400.
_STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.BUSY: (429, "rate_limit_error"),
    ErrorCode.SHUTDOWN: (503, "service_unavailable_error"),
    ErrorCode.ENGINE_DEAD: (503, "service_unavailable_error"),
    ErrorCode.ENGINE_ERROR: (500, "server_error"),
    ErrorCode.UNAUTHORIZED: (401, "authentication_error"),
    ErrorCode.FORBIDDEN: (403, "permission_error"),
}
#: Apply_chat_template's own arguments: a request may set template variables, never these.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_FIELD = re.compile(r"field '(\w+)'")
#: Body fields handed to the wire as they are (the wire checks them): OpenAI's, and the ones vLLM
#: takes at the top level (the openai SDK's ``extra_body`` lands there).
_PASSED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "priority",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
)
#: The deepest nesting of arrays and objects a body may have. OpenAI's bodies need about 5 levels;
#: the bound is checked on the bytes before they are parsed, so no depth reaches the parser's recursion.
MAX_JSON_DEPTH = 64
#: A JSON string (what a bracket inside one is not), possessive so a long one costs one pass.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*+"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
#: Openers to +1 and closers to -1 as signed bytes.
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
#: Characters of a client's value that an error message quotes.
_SHOWN = 40


@dataclass(frozen=True)
class Parsed:
    """One request, ready for the front end."""

    submit: Submit
    stream: bool = False
    include_usage: bool = False
    #: Chat template variables (``chat_template_kwargs``): the caller renders the template with them.
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The body's name for the token budget, for errors about it.
    max_tokens_field: str = "max_tokens"
    #: Choices asked for: ``submits`` are the sequences that answer them (``protocol.expand_n``).
    n: int = 1
    #: The chat as the template takes it (tool messages and calls kept; ``submit.messages`` has
    #: only roles and text) and the request's tools (``scheduler.tool_calls``).
    chat_messages: list[dict[str, Any]] = field(default_factory=list)
    tools: Any = None

    @property
    def submits(self) -> list[Submit]:
        return expand_n(self.submit, self.n)


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (exact for valid JSON; an unterminated
    string can only make it larger), without parsing it: C-speed passes over the bytes."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if len(brackets) <= MAX_JSON_DEPTH:
        return len(brackets)  # a bound, and all a caller compares with MAX_JSON_DEPTH needs
    return max(accumulate(memoryview(brackets.translate(_DEPTH_STEP)).cast("b")))


def load_json(raw: bytes) -> Any:
    """A request body as JSON, or a 400 ``malformed``: not UTF-8, invalid JSON, or nested deeper than
    ``MAX_JSON_DEPTH`` (refused before parsing, so a deep body never reaches the parser's recursion).
    Integer literals the parser takes (up to Python's 4300 digits) are range-checked per field."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise HTTPError(
            400, f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels", code="malformed"
        )
    try:
        return json.loads(raw.decode("utf-8-sig"))  # UTF-8 only: the depth scan reads ASCII brackets
    except (ValueError, RecursionError) as exc:
        raise HTTPError(400, f"the request body is not valid JSON: {_clip(str(exc), 200)}", code="malformed") from None


def _clip(text: str, limit: int = _SHOWN) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_model(asked: Any, model: str) -> None:
    """A body's ``model``, where it names one, must be the model served (every door: OpenAI's,
    Anthropic's, tokenize): a 400 when it is not a string, a 404 ``model_not_found`` otherwise."""
    if asked is None:
        return
    if not isinstance(asked, str):
        raise HTTPError(400, "'model' must be a string", param="model", code=ErrorCode.BAD_FIELD.value)
    if asked != model:
        raise HTTPError(
            404,
            f"the model {_clip(repr(asked))} does not exist; this server serves {model!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def parse_body(body: Any, *, chat: bool, model: str, rid: str) -> Parsed:
    """Check an OpenAI body for ``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    check_model(body.get("model"), model)
    _refuse_unsupported(body, chat)
    wire: dict[str, Any] = {"v": 1, "type": MsgType.SUBMIT.value, "id": rid}
    messages: list[dict[str, Any]] = []
    if chat:
        messages = _messages(body.get("messages"))
        wire["messages"] = [{k: v for k, v in m.items() if isinstance(v, str)} for m in messages]
    else:
        _prompt(body.get("prompt"), wire)
    budget = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        budget = "max_completion_tokens"
    wire["max_tokens"] = body.get(budget)
    for name in _PASSED:
        wire[name] = body.get(name)
    wire["logprobs"], wire["top_logprobs"] = _logprobs(body, chat)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise HTTPError(400, "'user' must be a string", param="user", code=ErrorCode.BAD_FIELD.value)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise HTTPError(400, "'stream' must be a boolean", param="stream", code=ErrorCode.BAD_FIELD.value)
    try:
        wire["response_format"] = from_openai(body.get("response_format"))
        req = parse_request(wire)
    except ProtocolError as exc:
        raise from_protocol(exc.code, exc.message, chat=chat, max_tokens_field=budget) from None
    assert isinstance(req, Submit)
    n = _choices(body.get("n"), rid)
    return Parsed(
        n=n,
        chat_messages=messages,
        tools=parse_tools(body) if chat else None,
        submit=req,
        stream=bool(stream),
        include_usage=_include_usage(body.get("stream_options")),
        template_kwargs=_template_kwargs(body.get("chat_template_kwargs")) if chat else {},
        max_tokens_field=budget,
    )


def with_tokens(parsed: Parsed, ids: list[int]) -> Parsed:
    """The same request with its prompt already rendered and tokenized."""
    return replace(parsed, submit=replace(parsed.submit, messages=None, tokens=ids))


def from_protocol(
    code: str, message: str, *, chat: bool, max_tokens_field: str = "max_tokens", retry_after_s: float | None = None
) -> HTTPError:
    """The HTTP answer for a wire error code (a refused body, or a request's error ``end``)."""
    status, kind = _STATUS.get(code, (400, "invalid_request_error"))
    prompt = "messages" if chat else "prompt"
    named = _FIELD.search(message)
    param = named.group(1) if named else None
    param = {"tokens": prompt, "max_tokens": max_tokens_field}.get(param or "", param)
    if code in (ErrorCode.PROMPT_TOO_LONG, ErrorCode.EMPTY_PROMPT, ErrorCode.TOKEN_OUT_OF_RANGE):
        param = prompt
    elif code == ErrorCode.NO_CHAT_TEMPLATE or message.startswith("messages["):
        param = "messages"
    elif code == ErrorCode.MAX_TOKENS_OUT_OF_RANGE:
        param = max_tokens_field
    headers = {}
    if code == ErrorCode.BUSY:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s or 1.0)))
    return HTTPError(status, message, param=param, code=code, kind=kind, headers=headers)


def _choices(n: Any, rid: str) -> int:
    """``n``: how many choices, in ``[1, MAX_N]``; a 400 naming ``n`` otherwise."""
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise HTTPError(
            400,
            f"'n' must be an integer in [1, {MAX_N}], got {_clip(repr(n))}",
            param="n",
            code=ErrorCode.BAD_FIELD.value,
        )
    return n


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    if body.get("functions") or body.get("function_call") is not None:
        name = "functions" if body.get("functions") else "function_call"
        raise unsupported(name, "(deprecated by OpenAI) is not supported: send 'tools' and 'tool_choice'")
    if not chat and (body.get("tools") or body.get("tool_choice") is not None):
        raise unsupported("tools" if body.get("tools") else "tool_choice", "is for /v1/chat/completions only")
    if not chat:
        if body.get("echo"):
            raise unsupported("echo", "is not supported")
        if body.get("best_of") not in (None, 1):
            raise unsupported("best_of", "must be 1")
        if body.get("suffix"):
            raise unsupported("suffix", "is not supported")


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[bool, Any]:
    """The wire's ``logprobs`` and ``top_logprobs`` from OpenAI's two spellings: chat's boolean
    ``logprobs`` with ``top_logprobs`` (which the wire range-checks), completions' ``logprobs: N``
    (the sampled token's logprob and the N most likely tokens')."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise HTTPError(400, "'logprobs' must be a boolean", param="logprobs", code=ErrorCode.BAD_FIELD.value)
        top = body.get("top_logprobs")
        if isinstance(top, int) and not isinstance(top, bool) and top > 0 and not value:
            raise HTTPError(
                400, "'top_logprobs' needs 'logprobs' set to true", param="top_logprobs", code=ErrorCode.BAD_FIELD.value
            )
        return bool(value), top
    if value is None or isinstance(value, bool):
        return bool(value), None
    if not isinstance(value, int):
        raise HTTPError(400, "'logprobs' must be an integer", param="logprobs", code=ErrorCode.BAD_FIELD.value)
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise HTTPError(
            400, f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs", code=ErrorCode.BAD_FIELD.value
        )
    return True, value


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise HTTPError(
            400,
            "'stream_options' must be an object whose 'include_usage' is a boolean",
            param="stream_options",
            code=ErrorCode.BAD_FIELD.value,
        )
    return bool(options.get("include_usage", False))


def _prompt(prompt: Any, wire: dict[str, Any]) -> None:
    """A string, a token list, or a list holding exactly one of those."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise unsupported("prompt", "holds several prompts: send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        wire["prompt"] = prompt
    elif isinstance(prompt, list):
        wire["tokens"] = prompt
    else:
        raise HTTPError(
            400, "'prompt' must be a string or a list of token ids", param="prompt", code=ErrorCode.BAD_FIELD.value
        )


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages: role and text content (text parts joined); tool messages and assistant tool
    calls as the chat template takes them (``tool_calls.template_message``)."""
    if not isinstance(messages, list):
        raise HTTPError(400, "'messages' must be a list", param="messages", code=ErrorCode.BAD_FIELD.value)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HTTPError(400, f"{where} must be an object with a 'role'", param="messages", code="bad_field")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise unsupported("messages", f"role {_clip(repr(m['role']))} in {where} is not supported")
        if m.get("function_call"):
            raise unsupported("messages", f"'function_call' in {where} is deprecated: send 'tool_calls'")
        if role == "tool" or (role == "assistant" and m.get("tool_calls")):
            out.append(template_message({**m, "role": role}, where))
            continue
        msg = {"role": role, "content": _content(m.get("content"), where)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise unsupported("messages", f"a part of {where}.content is not text; only text parts are supported")
        return "".join(texts)
    raise HTTPError(
        400, f"{where}.content must be a string or a list of text parts", param="messages", code="bad_field"
    )


def _template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HTTPError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs", code="bad_field")
    reserved = sorted(set(value) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise HTTPError(
            400,
            f"'chat_template_kwargs' may set template variables, not {reserved}",
            param="chat_template_kwargs",
            code="bad_field",
        )
    return dict(value)
