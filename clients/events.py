"""What a client gets back: stream events and the result of a whole request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ClientError(Exception):
    """Base of everything the client library raises on purpose."""


class RequestError(ClientError):
    """A call ended with an error. ``code`` is a stable ``ErrorCode`` value: one the daemon sent,
    or one the client raises itself when it cannot carry the call (``unsafe_address``,
    ``daemon_gone``, ``closed``)."""

    def __init__(
        self, code: str, message: str, request_id: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        #: With ``busy``: how long the daemon suggests waiting before sending again.
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ToolCall:
    """A call the model made, parsed by its family's tool-call parser: ``arguments`` is a JSON
    text (an object), as OpenAI's API carries it; ``id`` is the daemon's, for the tool's answer."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request. ``text`` is the decoded text they add (may be empty while a
    multi-byte character or a possible stop string is incomplete; a last event with no tokens
    may carry text held back until the end)."""

    request_id: str
    tokens: list[int]
    text: str
    logprobs: list[float] | None = None
    #: Per token, ``(token_id, logprob)`` of the most likely tokens, most likely first (when asked).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: The calls this event's text completed (a request with ``tools``): the text still holds them
    #: as the model wrote them.
    tool_calls: list[ToolCall] | None = None


@dataclass(frozen=True)
class EndEvent:
    """The one terminal event of a request."""

    request_id: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float | None]
    error: RequestError | None = None


Event = TokenEvent | EndEvent


@dataclass
class Result:
    """A finished request: everything its events carried, joined."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float | None] = field(default_factory=dict)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: Every call of the answer, in order (a request with ``tools``).
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.extend(event.tokens)
            self.text += event.text
            if event.logprobs is not None:
                self.logprobs = (self.logprobs or []) + list(event.logprobs)
            if event.top_logprobs is not None:
                self.top_logprobs = (self.top_logprobs or []) + list(event.top_logprobs)
            if event.tool_calls:
                self.tool_calls.extend(event.tool_calls)
        else:
            self.finish_reason = event.finish_reason
            self.usage = event.usage
            self.timings = event.timings


def event_from_message(msg: dict[str, Any]) -> Event | None:
    """A token, end or error message as an event (an ``error`` for a request ends it)."""
    kind, rid = msg.get("type"), str(msg.get("id"))
    if kind == "token":
        tops = msg.get("top_logprobs")
        return TokenEvent(
            rid,
            list(msg.get("tokens", [])),
            str(msg.get("text", "")),
            msg.get("logprobs"),
            None if tops is None else [[(int(t), float(lp)) for t, lp in row] for row in tops],
            _calls(msg.get("tool_calls")),
        )
    if kind == "end":
        err = msg.get("error")
        error = (
            RequestError(err["code"], err["message"], rid, err.get("retry_after_s")) if isinstance(err, dict) else None
        )
        return EndEvent(
            rid, str(msg.get("finish_reason")), dict(msg.get("usage") or {}), dict(msg.get("timings") or {}), error
        )
    if kind == "error":
        error = RequestError(str(msg.get("code")), str(msg.get("message")), rid)
        return EndEvent(rid, "error", {}, {}, error)
    return None


def _calls(value: Any) -> list[ToolCall] | None:
    """A ``token`` message's ``tool_calls`` (``None`` when it has none)."""
    if not isinstance(value, list) or not value:
        return None
    return [
        ToolCall(str(c.get("id", "")), str(c.get("name", "")), str(c.get("arguments", "")))
        for c in value
        if isinstance(c, dict)
    ]
