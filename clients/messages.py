"""The maps each side sends: a client's requests and the daemon's events, built here so that both
sides spell every field the same way (``parse`` reads them back), and ``unbatch`` to take a
``batch`` frame apart.
"""

from __future__ import annotations

import json
from typing import Any

from clients.protocol import RESPONSE_FORMATS, Submit
from clients.wire import PROTOCOL_VERSION, ErrorCode, FinishReason, MsgType


def submit_message(req: Submit) -> dict[str, Any]:
    """The wire map for a submit (the client side of ``parse._parse_submit``)."""
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": MsgType.SUBMIT.value, "id": req.id}
    if req.prompt is not None:
        msg["prompt"] = req.prompt
    if req.tokens is not None:
        msg["tokens"] = list(req.tokens)
    if req.messages is not None:
        msg["messages"] = list(req.messages)
    if req.max_tokens is not None:
        msg["max_tokens"] = req.max_tokens
    s = req.sampling
    msg.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p)
    if s.seed is not None:
        msg["seed"] = s.seed
    if s.presence_penalty:
        msg["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        msg["frequency_penalty"] = s.frequency_penalty
    if s.repetition_penalty is not None:
        msg["repetition_penalty"] = s.repetition_penalty
    if s.logit_bias:
        msg["logit_bias"] = {str(t): b for t, b in s.logit_bias}
    if s.min_tokens:
        msg["min_tokens"] = s.min_tokens
    if s.ignore_eos:
        msg["ignore_eos"] = True
    if s.response_format is not None:
        kind, text = s.response_format
        key = RESPONSE_FORMATS[kind]
        msg["response_format"] = {"type": kind}
        if key is not None:
            msg["response_format"][key] = json.loads(text) if kind == "json_schema" else text
    if req.stop:
        msg["stop"] = list(req.stop)
    if req.stop_token_ids:
        msg["stop_token_ids"] = list(req.stop_token_ids)
    if req.logprobs:
        msg["logprobs"] = True
    if req.top_logprobs:
        msg["top_logprobs"] = req.top_logprobs
    if req.priority:
        msg["priority"] = req.priority
    if req.group is not None:
        msg["group"], msg["group_size"] = req.group
    if req.batch:
        msg["batch"] = True
    if req.tools is not None:
        msg["tools"], msg["tool_choice"] = list(req.tools.tools), req.tools.choice
        if not req.tools.parallel and req.tools.name is None:
            msg["parallel_tool_calls"] = False
    return msg


def simple_message(kind: MsgType, rid: str) -> dict[str, Any]:
    """A cancel, health or stats request."""
    return {"v": PROTOCOL_VERSION, "type": kind.value, "id": rid}


def error_message(code: ErrorCode, message: str, rid: str | None) -> dict[str, Any]:
    """A refusal that ends no request: unreadable messages, duplicate ids, unknown cancels."""
    return {"v": PROTOCOL_VERSION, "type": MsgType.ERROR.value, "id": rid, "code": code.value, "message": message}


def token_message(
    rid: str,
    tokens: list[int],
    text: str | None,
    logprobs: list[float] | None,
    top_logprobs: list[list[tuple[int, float]]] | None = None,
    tool_calls: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """``top_logprobs``: per token, ``(token_id, logprob)`` pairs most likely first; sent as
    ``[token_id, logprob]`` lists (msgpack has no tuples, and JSON neither). ``tool_calls``: the
    calls this text completed, each ``{"id", "name", "arguments"}`` (the arguments a JSON text)."""
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": MsgType.TOKEN.value, "id": rid, "tokens": tokens}
    if text is not None:
        msg["text"] = text
    if logprobs is not None:
        msg["logprobs"] = logprobs
    if top_logprobs is not None:
        msg["top_logprobs"] = [[[t, lp] for t, lp in row] for row in top_logprobs]
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def end_message(
    rid: str,
    finish_reason: FinishReason,
    usage: dict[str, int],
    timings: dict[str, float | None],
    error: tuple[ErrorCode, str] | None = None,
    retry_after_s: float | None = None,
) -> dict[str, Any]:
    """The one terminal event of a request. ``retry_after_s`` accompanies ``busy``."""
    msg: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "type": MsgType.END.value,
        "id": rid,
        "finish_reason": finish_reason.value,
        "usage": usage,
        "timings": timings,
    }
    if error is not None:
        msg["error"] = {"code": error[0].value, "message": error[1]}
        if retry_after_s is not None:
            msg["error"]["retry_after_s"] = retry_after_s
    return msg


def empty_usage(prompt_tokens: int = 0) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": 0}


def empty_timings() -> dict[str, float | None]:
    return {"queue_s": None, "ttft_s": None, "decode_s": None, "total_s": None}


def batch_message(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One frame for several events to one connection: a step's events cost one send, not one each."""
    return {"v": PROTOCOL_VERSION, "type": MsgType.BATCH.value, "events": events}


def unbatch(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """The events a daemon message carries, in order (a ``batch`` holds several, any other one)."""
    if msg.get("type") != MsgType.BATCH.value:
        return [msg]
    events = msg.get("events")
    return [e for e in events if isinstance(e, dict)] if isinstance(events, list) else []
