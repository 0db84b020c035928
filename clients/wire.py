"""The wire's vocabulary and framing: the protocol version, the message types, finish reasons and
error codes, and one frame <-> one map.

Every message is one ZeroMQ frame holding a msgpack map. ``unpack`` is where a frame from the
other side is first read, so it bounds what a hostile frame can make the reader allocate. The
messages themselves (what each holds) are in ``protocol``, which re-exports everything here; how
requests are checked is in ``parse``, the maps each side sends in ``messages``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgpack

PROTOCOL_VERSION = 1

#: Frames above this many bytes are refused with ``frame_too_large`` (configurable on the daemon).
DEFAULT_MAX_FRAME_BYTES = 1 << 20


class MsgType(StrEnum):
    """The ``type`` field. Requests flow client -> daemon, the rest daemon -> client."""

    SUBMIT = "submit"
    CANCEL = "cancel"
    HEALTH = "health"
    STATS = "stats"
    TOKEN = "token"
    END = "end"
    ERROR = "error"
    #: Several daemon -> client events for one connection, in order (one step's tokens for its requests).
    BATCH = "batch"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


class ErrorCode(StrEnum):
    """Stable error codes. Clients may switch on these; the messages are for people."""

    MALFORMED = "malformed"
    BAD_VERSION = "bad_version"
    UNKNOWN_TYPE = "unknown_type"
    MISSING_FIELD = "missing_field"
    BAD_FIELD = "bad_field"
    EMPTY_PROMPT = "empty_prompt"
    TOKEN_OUT_OF_RANGE = "token_out_of_range"
    PROMPT_TOO_LONG = "prompt_too_long"
    MAX_TOKENS_OUT_OF_RANGE = "max_tokens_out_of_range"
    NO_CHAT_TEMPLATE = "no_chat_template"
    #: ``tools`` sent for a model whose family has no tool-call parser, or whose template ignores tools.
    NO_TOOL_SUPPORT = "no_tool_support"
    #: A value the daemon cannot honour for this model (a forced ``tool_choice`` its family's call
    #: format cannot be enforced for); the message names the field.
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    FRAME_TOO_LARGE = "frame_too_large"
    BAD_FRAMES = "bad_frames"
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    UNKNOWN_REQUEST_ID = "unknown_request_id"
    SHUTDOWN = "shutdown"
    ENGINE_ERROR = "engine_error"
    ENGINE_DEAD = "engine_dead"
    BUSY = "busy"
    KV_BUDGET = "kv_budget"
    UNAUTHORIZED = "unauthorized"
    #: The caller is known but may not do this (an operator-only request from a plain tenant).
    FORBIDDEN = "forbidden"
    #: The connection closed or fell silent past its heartbeat TTL, or read nothing for the daemon's
    #: park timeout: its requests end so.
    DISCONNECTED = "disconnected"
    # Raised by the client library itself, never sent by the daemon:
    #: The ipc socket's folder (or the socket) is not owned by you or is writable by others.
    UNSAFE_ADDRESS = "unsafe_address"
    #: The daemon went away (died, or the connection broke) while a call was in flight.
    DAEMON_GONE = "daemon_gone"
    #: ``close()`` was called while this call was in flight.
    CLOSED = "closed"
    #: The daemon refused this connection's handshake: it holds as many ZeroMQ connections as it
    #: allows (its ``zmq_max_connections``). The same code is the HTTP door's 503 for its own cap.
    TOO_MANY_CONNECTIONS = "too_many_connections"


class ProtocolError(Exception):
    """A message the daemon refuses. ``request_id`` is set when the offending message had a
    readable id, so the refusal can be addressed to that request."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


# --------------------------------------------------------------------------- encoding


def pack(message: dict[str, Any]) -> bytes:
    """Encode one message. ``use_bin_type`` keeps str and bytes distinct on the wire."""
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> dict[str, Any]:
    """Decode one frame into a map, or raise ``ProtocolError``.

    The msgpack limits bound what a hostile frame can make us allocate: no container or
    string can be longer than the frame itself.
    """
    if len(frame) > max_bytes:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE,
            f"frame is {len(frame)} bytes; the daemon accepts at most {max_bytes}",
        )
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=len(frame),
            max_bin_len=len(frame),
            max_array_len=len(frame),
            max_map_len=len(frame),
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ExtraData, ValueError, ...)
        raise ProtocolError(ErrorCode.MALFORMED, f"frame is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.MALFORMED, f"a message must be a msgpack map, got {type(obj).__name__}")
    if not all(isinstance(k, str) for k in obj):
        raise ProtocolError(ErrorCode.MALFORMED, "map keys must be strings")
    return obj
