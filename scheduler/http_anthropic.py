"""Anthropic's Messages API on the HTTP door: ``POST /v1/messages``, whole and streamed, and
``POST /v1/messages/count_tokens``.

A body is checked here, turned into a wire ``Submit`` and held to ``clients.protocol``'s own checks,
so it meets the tenants, fair queue, limits and metrics of any other request (``scheduler.http_api``
runs it). The chat template is rendered here, off the event loop, so the prompt's token count is
known for ``message_start`` and a final assistant message is continued (Anthropic's prefill) rather
than closed. Tools, tool use and tool results (``scheduler.anthropic_tools``) and thinking blocks go
through the chat template and the OpenAI door's answer splitting (``scheduler.anthropic_reply``).
Errors are Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with
the daemon's stable ``code`` added.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from clients.parse import parse_request
from clients.protocol import ErrorCode, MsgType, ProtocolError, Submit
from scheduler import tool_calls, tool_grammar
from scheduler.anthropic_reply import Reply, event
from scheduler.anthropic_tools import convert_messages, parse_tools, wire_messages
from scheduler.http_api import Api, Stream
from scheduler.http_errors import HTTPError, unsupported
from scheduler.http_openai import check_model, from_protocol
from scheduler.tool_calls import Tools

if TYPE_CHECKING:
    from scheduler.local import LocalConnection

#: Fields this door reads; any other is refused, as Anthropic's API refuses extra inputs.
_ACCEPTED = frozenset(
    {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k"}
    | {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "tools", "tool_choice", "thinking"}
)
#: Fields ``/v1/messages/count_tokens`` reads: a message's prompt, without what only generation takes.
_COUNTED = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control"})
#: Anthropic's error type per HTTP status.
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
#: Template renders at once, all Anthropic requests together (each is one worker thread).
RENDERS = 4


def error_body(err: HTTPError) -> dict[str, Any]:
    error: dict[str, Any] = {"type": _ERROR_TYPE.get(err.status, "api_error"), "message": err.message}
    if err.code is not None:
        error["code"] = err.code
    return {"type": "error", "error": error}


def error_response(err: HTTPError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


def _bad(message: str, param: str, code: str = ErrorCode.BAD_FIELD.value) -> HTTPError:
    return HTTPError(400, message, param=param, code=code)


@dataclass(frozen=True)
class MessagesRequest:
    """One checked ``/v1/messages`` body: the submit (still with its messages), how to answer."""

    submit: Submit
    stream: bool
    stops: list[str]
    #: The last message is the assistant's: the answer continues it (Anthropic's prefill).
    prefill: bool
    #: The chat as the template takes it (tool calls and results kept) and the request's tools.
    messages: list[dict[str, Any]]
    tools: Tools | None = None
    #: ``thinking`` enabled: the model's thinking comes back as thinking blocks.
    thinking: bool = False


def parse_messages(body: Any, *, model: str, rid: str) -> MessagesRequest:
    """Check a ``/v1/messages`` body; a 400 naming the field for anything this door does not take."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object", code=ErrorCode.MALFORMED.value)
    unknown = sorted(set(body) - _ACCEPTED)
    if unknown:
        raise _bad(f"unknown field {unknown[0]!r}: extra inputs are not permitted", unknown[0], "unknown_parameter")
    check_model(body.get("model"), model)
    tools = parse_tools(body)
    thinking = _thinking(body.get("thinking"))
    if body.get("max_tokens") is None:
        raise _bad("'max_tokens' is required", "max_tokens", ErrorCode.MISSING_FIELD.value)
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _bad("'stop_sequences' must be a list of strings", "stop_sequences")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("'metadata' must be an object", "metadata")
    messages = convert_messages(body.get("messages"))
    system = body.get("system")
    if system is not None:
        messages.insert(0, {"role": "system", "content": _text(system, "system", "system")})
    wire: dict[str, Any] = {"v": 1, "type": MsgType.SUBMIT.value, "id": rid, "messages": wire_messages(messages)}
    wire["max_tokens"], wire["stop"] = body["max_tokens"], stops
    for name in ("temperature", "top_p", "top_k"):
        wire[name] = body.get(name)
    try:
        req = parse_request(wire)
    except ProtocolError as exc:
        raise from_protocol(exc.code, exc.message.replace("'stop'", "'stop_sequences'"), chat=True) from None
    assert isinstance(req, Submit)
    last = messages[-1]
    prefill = last["role"] == "assistant" and "tool_calls" not in last
    return MessagesRequest(req, bool(stream), list(stops or []), prefill, messages, tools, thinking)


def _thinking(value: Any) -> bool:
    """``thinking``: ``{"type": "disabled"}`` (the default) or ``{"type": "enabled", "budget_tokens": N}``."""
    if value is None or (isinstance(value, dict) and value.get("type") == "disabled"):
        return False
    if not isinstance(value, dict) or value.get("type") != "enabled":
        raise unsupported("thinking", "must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}")
    budget = value.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise _bad("'thinking.budget_tokens' must be a positive integer", "thinking")
    return True


def _text(value: Any, where: str, param: str) -> str:
    """A string, or a list of text blocks joined; any other block (images, tool use) is refused."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"{where} must be a string or a list of content blocks", param)
    texts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{where}[{i}] must be a content block with a 'type'", param)
        if block["type"] != "text":
            raise unsupported(param, f"block {block['type'][:40]!r} in {where}[{i}] is not supported (only text)")
        if not isinstance(block.get("text"), str):
            raise _bad(f"{where}[{i}].text must be a string", param)
        texts.append(block["text"])
    return "".join(texts)


def render(tokenizer: Any, req: MessagesRequest) -> list[int]:
    """The prompt's token ids, as the front end renders chat messages, with the tools; a final
    assistant message is continued, not closed. A model that thinks is asked to only with
    ``thinking`` enabled (Anthropic's default is not to), where its template takes ``enable_thinking``."""
    kwargs: dict[str, Any] = {}
    if req.tools is not None:
        kwargs["tools"] = req.tools.tools
    if getattr(tokenizer, "has_thinking", False):
        kwargs["enable_thinking"] = req.thinking
    if req.prefill:
        return list(tokenizer.apply_chat_template(req.messages, continue_final_message=True, **kwargs))
    return list(tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, **kwargs))


class MessagesDoor:
    """``POST /v1/messages`` on top of the OpenAI door's checks and connection handling (``Api``)."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self._renders = anyio.CapacityLimiter(RENDERS)

    async def messages(self, request: Request) -> Response:
        try:
            return await self._messages(request)
        except HTTPError as err:
            return error_response(err)

    async def _messages(self, request: Request) -> Response:
        api, front = self.api, self.api.front
        tenant = api._tenant(request)
        info = api._ready()
        body = await api._body(request)
        rid = f"msg_{uuid.uuid4().hex}"
        req = parse_messages(body, model=info.name, rid=rid)
        ids = await self._prompt(req, info)
        left_open = tool_calls.opens_thinking(front.tokenizer, ids)
        reply = Reply(
            rid, info.name, len(ids), req.stops, front.tokenizer, req.tools, req.thinking, req.thinking and left_open
        )
        conn = front.open_local(tenant)
        streaming = False
        try:
            response = await api._answer_one(
                conn,
                request,
                await anyio.to_thread.run_sync(self._submit, req, ids, info, left_open),
                stream=req.stream,
                raise_for=_raise_for,
                whole=reply.whole,
                events=partial(self._events, conn, reply),
            )
            streaming = isinstance(response, Stream)
            return response
        finally:
            if not streaming:
                conn.close()  # a stream's response closes it when the stream ends

    def _submit(self, req: MessagesRequest, ids: list[int], info: Any, left_open: bool) -> Submit:
        """The request with its rendered prompt, and the grammar of a forced ``tool_choice``
        (``left_open``: the prompt leaves a think block open, ``tool_calls.opens_thinking``)."""
        sub = replace(req.submit, messages=None, tokens=ids)
        return tool_grammar.enforce(sub, self.api.front.tokenizer, info.name, req.tools, left_open, info.vocab_size)

    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt tokens the same body
        would prefill on ``/v1/messages`` (its messages, system prompt, tools and thinking rendered by
        the chat template); nothing is generated."""
        try:
            api = self.api
            api._tenant(request)
            info = api._ready()
            body = await api._body(request)
            if isinstance(body, dict):
                unknown = sorted(set(body) - _COUNTED)
                if unknown:
                    raise _bad(
                        f"unknown field {unknown[0]!r}: extra inputs are not permitted", unknown[0], "unknown_parameter"
                    )
                body = {**body, "max_tokens": 1}  # counting takes none; the rest is checked as a message's
            req = parse_messages(body, model=info.name, rid=f"count_{uuid.uuid4().hex}")
            return JSONResponse({"input_tokens": len(await self._prompt(req, info))})
        except HTTPError as err:
            return error_response(err)

    async def _prompt(self, req: MessagesRequest, info: Any) -> list[int]:
        """The request's prompt ids, once the model can take it (a chat template; a tool parser for
        tools; thinking markers for ``thinking``)."""
        tokenizer = self.api.front.tokenizer
        if not info.has_chat_template:
            raise HTTPError(400, f"model {info.name!r} has no chat template", param="messages", code="no_chat_template")
        if req.tools is not None:
            await anyio.to_thread.run_sync(tool_calls.require_support, tokenizer, info.name)
        if req.thinking and not getattr(tokenizer, "has_thinking", False):
            raise unsupported("thinking", f"needs a model that thinks; {info.name!r} has no thinking markers")
        return await self._render(req)

    async def _render(self, req: MessagesRequest) -> list[int]:
        tokenizer = self.api.front.tokenizer
        try:
            return await anyio.to_thread.run_sync(render, tokenizer, req, limiter=self._renders)
        except Exception as exc:  # jinja errors from a template that rejects these messages
            raise _bad(f"the chat template rejected 'messages': {str(exc)[:200]}", "messages") from None

    async def _events(self, conn: LocalConnection, reply: Reply, first: dict[str, Any]) -> AsyncIterator[bytes]:
        for chunk in reply.opening():
            yield chunk
        msg: dict[str, Any] | None = first
        while msg is not None:
            if msg["type"] == "token":
                for chunk in reply.deltas(reply.add(msg)):
                    yield chunk
            else:
                err = msg.get("error") if msg["type"] == "end" else msg
                if err:
                    code = str(err.get("code") or ErrorCode.ENGINE_ERROR.value)
                    yield event(error_body(from_protocol(code, str(err.get("message") or code), chat=True)))
                else:
                    for chunk in reply.closing(msg):
                        yield chunk
                return
            try:
                msg = await conn.events.receive()
            except anyio.EndOfStream:
                msg = None


def _raise_for(msg: dict[str, Any]) -> None:
    """A request that ended in an error before any answer was sent: its HTTP status."""
    err = msg.get("error") or {}
    if msg["type"] == "end" and not err:
        return
    code = str(err.get("code") or msg.get("code") or ErrorCode.ENGINE_ERROR.value)
    message = str(err.get("message") or msg.get("message") or code).replace("'stop'", "'stop_sequences'")
    raise from_protocol(code, message, chat=True, retry_after_s=err.get("retry_after_s"))
