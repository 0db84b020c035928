"""The HTTP door's application: every route (OpenAI, Anthropic, tokenize, metrics) and the error
handlers that turn any failure into the OpenAI error shape, never a traceback."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from scheduler.http_anthropic import MessagesDoor
from scheduler.http_api import Api
from scheduler.http_errors import HTTPError
from scheduler.http_tokenize import MetricsRoute, TokenRoutes

if TYPE_CHECKING:
    from scheduler.http_front import Front


def error_response(err: HTTPError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPError)
    return error_response(exc)


async def _starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(HTTPError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(HTTPError(500, f"internal error: {exc!r}", code="internal_error", kind="server_error"))


def build_app(front: Front, exposition: Any = None) -> Starlette:
    """The HTTP door's routes; ``exposition`` (the metrics ASGI app) is also served at ``/metrics``."""
    api = Api(front)
    door, tokens = MessagesDoor(api), TokenRoutes(api)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/messages", door.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", door.count_tokens, methods=["POST"]),
        Route("/tokenize", tokens.tokenize, methods=["POST"]),
        Route("/detokenize", tokens.detokenize, methods=["POST"]),
    ]
    if exposition is not None:
        routes.append(Route("/metrics", MetricsRoute(api, exposition), methods=["GET"]))
    handlers = {HTTPError: _http_error, HTTPException: _starlette_error, Exception: _server_error}
    return Starlette(routes=routes, exception_handlers=handlers)
