"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/health``
(gathered with the other doors' routes into one app by ``scheduler.http_app``).

Each generation request opens one in-process connection to the front end
(``FrontEnd.open_local``), submits one wire ``Submit`` on it and turns the wire events back into
OpenAI objects, so it meets the tenants, fair queue, limits, bursts and metrics of a ZeroMQ request.
The answer waits for the request's first event: a refusal (busy, too long, draining) is then still
an HTTP status, not an error inside a 200 stream. A client that goes away, before or during its
answer, closes the connection, which ends the request ``disconnected`` and frees its slot.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from scheduler import http_choices, tool_calls, tool_grammar
from scheduler.chat_reply import SplitReply
from scheduler.http_auth import tenant_for
from scheduler.http_errors import HTTPError
from scheduler.http_openai import Parsed, from_protocol, load_json, parse_body, with_tokens
from scheduler.http_shapes import DONE, Reply, sse
from scheduler.transport import HARD_FRAME_FACTOR

if TYPE_CHECKING:
    from clients.protocol import Submit
    from scheduler.http_front import Front
    from scheduler.local import LocalConnection

#: Bodies up to this multiple of the limit are read and answered 413; larger ones are answered at
#: once and the connection closed, as ZeroMQ frames are.
HARD_BODY_FACTOR = HARD_FRAME_FACTOR
#: Seconds between SSE comment lines on a quiet stream (a long queue), so proxies keep it open.
PING_S = 15.0


class Stream(EventSourceResponse):
    """An SSE answer that owns its connection: it is closed however the response ends, also when
    the client leaves before the first chunk is sent (the body generator never ran then)."""

    def __init__(self, content: AsyncIterator[bytes], conn: LocalConnection) -> None:
        super().__init__(content, ping=PING_S, sep="\n")
        self._conn = conn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._conn.close()


class Api:
    def __init__(self, front: Front) -> None:
        self.front = front
        self.started = int(time.time())

    # ------------------------------------------------------------------ plain routes

    async def health(self, request: Request) -> Response:
        info = self.front.model_info
        status = self.front.status
        body = {"status": status, "model": info.name if info is not None else None}
        return JSONResponse(body, status_code=200 if status == "ready" else 503)

    async def models(self, request: Request) -> Response:
        self._tenant(request)
        name = self._ready().name
        card = {"id": name, "object": "model", "created": self.started, "owned_by": "mlx-batchd"}
        return JSONResponse({"object": "list", "data": [card]})

    async def model(self, request: Request) -> Response:
        self._tenant(request)
        name = self._ready().name
        if request.path_params["model_id"] != name:
            raise HTTPError(
                404, f"the model {request.path_params['model_id']!r} does not exist", code="model_not_found"
            )
        return JSONResponse({"id": name, "object": "model", "created": self.started, "owned_by": "mlx-batchd"})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    # ------------------------------------------------------------------ checks

    def _ready(self) -> Any:
        info = self.front.model_info
        if self.front.status == "shutting_down":
            raise HTTPError(503, "the daemon is shutting down", code="shutdown", kind="service_unavailable_error")
        if info is None:
            raise HTTPError(
                503, "the model is still loading", code="loading", kind="service_unavailable_error",
                headers={"Retry-After": "1"},
            )  # fmt: skip
        return info

    def _tenant(self, request: Request) -> str:
        tenant = tenant_for(self.front.tenant_table, request.headers)
        if tenant is None:
            raise HTTPError(
                401,
                "missing or invalid API key: send `Authorization: Bearer KEY` with a key of your tenant",
                code="invalid_api_key",
                kind="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tenant.name

    async def _body(self, request: Request) -> Any:
        """The JSON body, within the size limit (413) and the time limit (408)."""
        limit = self.front.settings.max_frame_bytes
        declared = request.headers.get("content-length", "")
        too_large = HTTPError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        if declared.isdigit() and int(declared) > HARD_BODY_FACTOR * limit:
            too_large.headers["Connection"] = "close"
            raise too_large
        chunks, size = [], 0
        timeout = self.front.settings.http_body_timeout_s
        try:
            with anyio.fail_after(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > HARD_BODY_FACTOR * limit:
                        too_large.headers["Connection"] = "close"
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            raise HTTPError(
                408, f"the request body did not arrive within {timeout:g} s", code="timeout",
                headers={"Connection": "close"},
            ) from None  # fmt: skip
        if size > limit:
            raise too_large
        return load_json(b"".join(chunks))

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: Request, chat: bool) -> Response:
        tenant = self._tenant(request)
        info = self._ready()
        body = await self._body(request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        parsed = parse_body(body, chat=chat, model=info.name, rid=rid)
        tokenizer, reasoning_first = self.front.tokenizer, False
        if chat and tool_calls.renders_here(parsed, tokenizer):
            parsed, reasoning_first = await self._render(parsed, info)
        splits = chat and tool_calls.splits(parsed, tokenizer)
        make: Any = partial(SplitReply, tools=parsed.tools, reasoning_first=reasoning_first) if splits else Reply
        reply = make(
            chat=chat,
            rid=rid,
            model=info.name,
            created=int(time.time()),
            tokenizer=self.front.tokenizer,
            logprobs=parsed.submit.logprobs,
            include_usage=parsed.include_usage and parsed.stream,
        )
        conn = self.front.open_local(tenant)
        streaming = False
        try:
            if parsed.n > 1:  # n sequences on this connection, merged into n choices
                subs = parsed.submits
                for sub in subs:
                    conn.submit(sub)
                replies = [reply.for_choice(i) for i in range(len(subs))]
                out = await http_choices.answer(
                    conn,
                    request,
                    [s.id for s in subs],
                    replies,
                    parsed.stream,
                    lambda m: self._raise_for(m, parsed, chat),
                )
                if out is None:
                    return Response(status_code=499)
                if isinstance(out, dict):
                    return JSONResponse(out)
                streaming = True
                return Stream(out, conn)
            response = await self._answer_one(
                conn,
                request,
                parsed.submit,
                stream=parsed.stream,
                raise_for=lambda m: self._raise_for(m, parsed, chat),
                whole=reply.whole,
                events=partial(self._chunks, conn, reply),
            )
            streaming = isinstance(response, Stream)
            return response
        finally:
            if not streaming:
                conn.close()  # a stream's response closes it when the stream ends

    async def _render(self, parsed: Parsed, info: Any) -> tuple[Parsed, bool]:
        """The chat rendered here, not by the front end: the same tokenizer call with the template
        variables (``chat_template_kwargs``), tools and tool messages added; and whether the prompt
        leaves a think block open (the answer then starts in reasoning)."""
        if not info.has_chat_template:
            raise HTTPError(400, f"model {info.name!r} has no chat template", param="messages", code="no_chat_template")
        kwargs, tokenizer = parsed.template_kwargs, self.front.tokenizer
        tools = parsed.tools.tools if parsed.tools is not None else None
        if tools:
            await anyio.to_thread.run_sync(tool_calls.require_support, tokenizer, info.name)

        def render() -> tuple[list[int], bool]:
            ids = tool_calls.render(tokenizer, parsed.chat_messages, tools, **kwargs)
            return ids, tool_calls.opens_thinking(tokenizer, ids)

        try:
            ids, reasoning_first = await anyio.to_thread.run_sync(render)
        except Exception as exc:
            param = "chat_template_kwargs" if kwargs else "messages"
            raise HTTPError(
                400, f"the chat template rejected the request: {exc}", param=param, code="bad_field"
            ) from None
        parsed = with_tokens(parsed, ids)
        enforce = partial(tool_grammar.enforce, parsed.submit, tokenizer, info.name, parsed.tools, reasoning_first)
        forced = await anyio.to_thread.run_sync(enforce, info.vocab_size)
        return replace(parsed, submit=forced), reasoning_first

    @staticmethod
    def _raise_for(msg: dict[str, Any], parsed: Parsed, chat: bool) -> None:
        """A request that ended in an error before any answer was sent: its HTTP status."""
        err = msg.get("error") or {}
        if msg["type"] == "end" and not err:
            return
        code = str(err.get("code") or msg.get("code") or "engine_error")
        message = str(err.get("message") or msg.get("message") or code)
        raise from_protocol(
            code, message, chat=chat, max_tokens_field=parsed.max_tokens_field, retry_after_s=err.get("retry_after_s")
        )

    async def _answer_one(
        self,
        conn: LocalConnection,
        request: Request,
        submit: Submit,
        *,
        stream: bool,
        raise_for: Callable[[dict[str, Any]], None],
        whole: Callable[[list[dict[str, Any]]], dict[str, Any]],
        events: Callable[[dict[str, Any]], AsyncIterator[bytes]],
    ) -> Response:
        """One request on ``conn``, answered whole (``whole`` of its events, as JSON) or as a
        ``Stream`` (``events`` from its first event on; the stream then owns ``conn``); an error
        before the answer began is ``raise_for``'s HTTP error, and a client that left first a 499."""
        conn.submit(submit)
        got = await self._read(conn, request, whole=not stream)
        if got is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if got[-1]["type"] != "token":
            raise_for(got[-1])
        if not stream:
            return JSONResponse(whole(got))
        return Stream(events(got[0]), conn)

    @staticmethod
    async def _read(conn: LocalConnection, request: Request, *, whole: bool) -> list[dict[str, Any]] | None:
        """The first event (``whole`` False) or every event up to the end; ``None`` if the client
        disconnected first."""
        got: list[dict[str, Any]] = []

        def take(msg: dict[str, Any]) -> bool:
            got.append(msg)
            return not whole or msg["type"] != "token"

        return got if await http_choices.read_until(conn, request, take) and got else None

    async def _chunks(self, conn: LocalConnection, reply: Reply, first: dict[str, Any]) -> AsyncIterator[bytes]:
        opening = reply.first_chunk()
        if opening is not None:
            yield sse(opening)
        msg: dict[str, Any] | None = first
        while msg is not None:
            if msg["type"] == "token":
                for chunk in reply.token_chunks(msg):
                    yield sse(chunk)
            else:
                err = msg.get("error") if msg["type"] == "end" else msg
                if err:
                    code = str(err.get("code") or "engine_error")
                    yield sse(from_protocol(code, str(err.get("message") or code), chat=reply.chat).body())
                else:
                    for chunk in reply.final_chunks(msg):
                        yield sse(chunk)
                yield DONE
                return
            try:
                msg = await conn.events.receive()
            except anyio.EndOfStream:
                msg = None
