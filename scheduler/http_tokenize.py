"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, and ``GET /metrics`` on the HTTP door.

``/tokenize`` gives the ids the daemon would prefill for a ``prompt`` (``tokenizer.encode``) or for
chat ``messages`` (the chat template, as the front end renders it), with the model's context length;
``/detokenize`` turns ids back into text. Both run in worker threads, a few at a time, off the event
loop. ``/metrics`` is the ``--metrics`` listener's exposition; it names every tenant, so only the
operator (an admin tenant, or the local user without a tenants file) may read it here.
"""

from __future__ import annotations

from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from clients.protocol import ErrorCode
from scheduler.http_api import Api
from scheduler.http_auth import tenant_for
from scheduler.http_errors import HTTPError
from scheduler.http_openai import _messages, _template_kwargs, check_model

#: Tokenizer calls these routes make at once (each is one worker thread).
CALLS = 2


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise HTTPError(400, f"{name!r} must be a boolean", param=name, code=ErrorCode.BAD_FIELD.value)
    return value


def _check_model(body: Any, model: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object", code=ErrorCode.MALFORMED.value)
    check_model(body.get("model"), model)
    return body


class TokenRoutes:
    """``/tokenize`` and ``/detokenize``, behind the OpenAI door's key check (``Api``)."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self._calls = anyio.CapacityLimiter(CALLS)

    async def tokenize(self, request: Request) -> Response:
        api = self.api
        api._tenant(request)
        info = api._ready()
        body = _check_model(await api._body(request), info.name)
        tokenizer = api.front.tokenizer
        strs = _flag(body, "return_token_strs", False)
        if ("prompt" in body) == ("messages" in body):
            raise HTTPError(400, "give exactly one of 'prompt' and 'messages'", code=ErrorCode.BAD_FIELD.value)
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise HTTPError(400, "'prompt' must be a string", param="prompt", code=ErrorCode.BAD_FIELD.value)
            special = _flag(body, "add_special_tokens", True)

            def encode() -> list[int]:
                return list(tokenizer.encode(prompt, add_special_tokens=special))
        else:
            if not info.has_chat_template:
                raise HTTPError(
                    400, f"model {info.name!r} has no chat template", param="messages", code="no_chat_template"
                )
            messages = _messages(body["messages"])
            generation = _flag(body, "add_generation_prompt", True)
            kwargs = _template_kwargs(body.get("chat_template_kwargs"))

            def encode() -> list[int]:
                return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation, **kwargs))

        try:
            tokens = await anyio.to_thread.run_sync(encode, limiter=self._calls)
        except Exception as exc:  # jinja errors from a template that rejects these messages
            raise HTTPError(
                400, f"the chat template rejected 'messages': {str(exc)[:200]}", param="messages", code="bad_field"
            ) from None
        out: dict[str, Any] = {"count": len(tokens), "max_model_len": info.context_length, "tokens": tokens}
        out["token_strs"] = list(tokenizer.convert_ids_to_tokens(tokens)) if strs else None
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> Response:
        api = self.api
        api._tenant(request)
        info = api._ready()
        body = _check_model(await api._body(request), info.name)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise HTTPError(400, "'tokens' must be a list of integers", param="tokens", code=ErrorCode.BAD_FIELD.value)
        for i, t in enumerate(tokens):
            if not 0 <= t < info.vocab_size:
                raise HTTPError(
                    400, f"tokens[{i}] = {t} is outside the vocabulary [0, {info.vocab_size})", param="tokens",
                    code=ErrorCode.TOKEN_OUT_OF_RANGE.value,
                )  # fmt: skip
        tokenizer = api.front.tokenizer
        text = await anyio.to_thread.run_sync(lambda: str(tokenizer.decode(tokens)), limiter=self._calls)
        return JSONResponse({"prompt": text})


class MetricsRoute:
    """``GET /metrics``: the exposition app's answer, for the operator only (a plain tenant: 403;
    no key or a wrong one: 401). An ASGI app, so the exposition app answers the request itself."""

    def __init__(self, api: Api, exposition: ASGIApp) -> None:
        self.api = api
        self._exposition = exposition

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        table = self.api.front.tenant_table
        try:
            tenant = tenant_for(table, request.headers)
            if tenant is None:
                self.api._tenant(request)  # the 401 every route answers
            elif not table.is_operator(tenant):
                raise HTTPError(
                    403, "the metrics name every tenant: only an admin tenant may read them", code="forbidden",
                    kind="permission_error",
                )  # fmt: skip
        except HTTPError as err:
            response = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
            await response(scope, receive, send)
            return
        await self._exposition(scope, receive, send)
