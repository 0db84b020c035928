"""The mlx-batchd client library. Imports no MLX, so a client app stays light."""

from clients.address import default_address
from clients.client import DEFAULT_CALL_TIMEOUT, AsyncClient
from clients.events import ClientError, EndEvent, Event, RequestError, Result, TokenEvent, ToolCall
from clients.protocol import PROTOCOL_VERSION, ErrorCode, FinishReason
from clients.sync import Client

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "PROTOCOL_VERSION",
    "AsyncClient",
    "Client",
    "ClientError",
    "EndEvent",
    "ErrorCode",
    "Event",
    "FinishReason",
    "RequestError",
    "Result",
    "TokenEvent",
    "ToolCall",
    "default_address",
]
