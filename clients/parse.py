"""The checks a request map must pass before it becomes a typed request (``parse_request``), and
the expansion of one request into ``n`` sequences (``expand_n``).

These are the checks that need no model; the daemon checks the rest (vocabulary, context length,
its caps) once it knows the model. Every refusal is a ``ProtocolError`` naming the field to fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

from clients.protocol import (
    MAX_BIAS,
    MAX_COUNT,
    MAX_FORMAT_CHARS,
    MAX_GROUP_SIZE,
    MAX_ID_LENGTH,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    RESPONSE_FORMATS,
    Cancel,
    Health,
    Request,
    SamplingOptions,
    Stats,
    Submit,
)
from clients.tools import parse_tools
from clients.wire import PROTOCOL_VERSION, ErrorCode, MsgType, ProtocolError

#: Characters of a refused value that an error message quotes.
SHOWN_CHARS = 40


def _id_of(msg: dict[str, Any]) -> str | None:
    """The message's id if it is a usable one, so even a refused message can be answered by id."""
    rid = msg.get("id")
    if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LENGTH:
        return rid
    return None


def _show(value: Any) -> str:
    """A refused value as an error message quotes it: clipped, and a container by its type only, so
    a hostile value (huge, or nested thousands deep) costs nothing to describe."""
    if value is None or isinstance(value, bool | int | float | str):
        text = repr(value) if not isinstance(value, int) or abs(value) < 10**SHOWN_CHARS else "a huge integer"
        return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
    return f"a {type(value).__name__}"


def _get(msg: dict[str, Any], name: str, kinds: type | tuple[type, ...], rid: str | None, default: Any) -> Any:
    """One optional field, type-checked. ``bool`` is not accepted where a number is wanted."""
    if name not in msg or msg[name] is None:
        return default
    value = msg[name]
    bad_bool = isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,))
    if not isinstance(value, kinds) or bad_bool:
        want = kinds.__name__ if isinstance(kinds, type) else " or ".join(k.__name__ for k in kinds)
        raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be {want}, got {type(value).__name__}", rid)
    return value


def _number(msg: dict[str, Any], name: str, rid: str | None, default: float, lo: float, hi: float) -> float:
    """A finite number in ``[lo, hi]``. An integer is range-checked before it becomes a float, so a
    huge one is refused, never overflows."""
    value = _get(msg, name, (int, float), rid, default)
    if not (lo <= value <= hi and math.isfinite(value)):  # NaN fails the comparison
        raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be in [{lo}, {hi}], got {_show(value)}", rid)
    return float(value)


def _int(
    msg: dict[str, Any],
    name: str,
    rid: str | None,
    default: int | None,
    lo: int,
    hi: int,
    code: ErrorCode = ErrorCode.BAD_FIELD,
) -> Any:
    """An optional integer in ``[lo, hi]`` (``default`` when absent)."""
    value = _get(msg, name, int, rid, default)
    if value is not None and not lo <= value <= hi:
        raise ProtocolError(code, f"field {name!r} must be in [{lo}, {hi}], got {_show(value)}", rid)
    return value


def _int_list(
    msg: dict[str, Any], name: str, rid: str | None, max_len: int | None, code: ErrorCode
) -> list[int] | None:
    """A list of integers, each in ``[0, MAX_COUNT]`` (refused with ``code`` outside it)."""
    value = _get(msg, name, list, rid, None)
    if value is None:
        return None
    if max_len is not None and len(value) > max_len:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} holds at most {max_len} items", rid)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be a list of integers", rid)
    for i, t in enumerate(value):
        if not 0 <= t <= MAX_COUNT:
            raise ProtocolError(
                code, f"field {name!r} holds {_show(t)} at [{i}]; token ids are in [0, {MAX_COUNT}]", rid
            )
    return value


def _messages(msg: dict[str, Any], rid: str | None) -> list[dict[str, str]] | None:
    value = _get(msg, "messages", list, rid, None)
    if value is None:
        return None
    if len(value) > MAX_MESSAGES:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"field 'messages' holds at most {MAX_MESSAGES} items", rid)
    for i, m in enumerate(value):
        ok = (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in m.items())
        )
        if not ok:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"messages[{i}] must be a map of strings with 'role' and 'content'",
                rid,
            )
    return value


def _parse_submit(msg: dict[str, Any], rid: str) -> Submit:
    prompt = _get(msg, "prompt", str, rid, None)
    tokens = _int_list(msg, "tokens", rid, None, ErrorCode.TOKEN_OUT_OF_RANGE)
    messages = _messages(msg, rid)
    given = [n for n, v in (("prompt", prompt), ("tokens", tokens), ("messages", messages)) if v is not None]
    if not given:
        raise ProtocolError(ErrorCode.MISSING_FIELD, "submit needs one of 'prompt', 'tokens' or 'messages'", rid)
    if len(given) > 1:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"give exactly one of 'prompt', 'tokens', 'messages', not {given}", rid
        )
    if prompt == "" or tokens == [] or messages == []:
        raise ProtocolError(ErrorCode.EMPTY_PROMPT, f"the {given[0]!r} field is empty; send at least one token", rid)

    max_tokens = _int(msg, "max_tokens", rid, None, 1, MAX_COUNT, ErrorCode.MAX_TOKENS_OUT_OF_RANGE)
    top_k = _int(msg, "top_k", rid, 0, 0, MAX_COUNT)
    seed = _int(msg, "seed", rid, None, 0, MAX_SEED)
    top_p = _number(msg, "top_p", rid, 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise ProtocolError(ErrorCode.BAD_FIELD, "field 'top_p' must be in (0, 1]", rid)
    repetition = _get(msg, "repetition_penalty", (int, float), rid, None)
    if repetition is not None and not (0 < repetition <= MAX_REPETITION_PENALTY):  # NaN fails too
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"field 'repetition_penalty' must be in (0, {MAX_REPETITION_PENALTY}], got {_show(repetition)}",
            rid,
        )
    min_tokens = _int(msg, "min_tokens", rid, 0, 0, MAX_COUNT)
    if max_tokens is not None and min_tokens > max_tokens:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"field 'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", rid
        )
    sampling = SamplingOptions(
        temperature=_number(msg, "temperature", rid, 0.0, 0.0, 100.0),
        top_p=top_p,
        top_k=top_k,
        min_p=_number(msg, "min_p", rid, 0.0, 0.0, 1.0),
        seed=seed,
        presence_penalty=_number(msg, "presence_penalty", rid, 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(msg, "frequency_penalty", rid, 0.0, -MAX_PENALTY, MAX_PENALTY),
        # 1 multiplies nothing: the same as off, and no processor runs for it.
        repetition_penalty=None if repetition is None or repetition == 1 else float(repetition),
        logit_bias=_logit_bias(msg, rid),
        min_tokens=min_tokens,
        ignore_eos=bool(_get(msg, "ignore_eos", bool, rid, False)),
        response_format=parse_response_format(_get(msg, "response_format", dict, rid, None), rid),
    )
    if sampling.min_tokens and sampling.response_format is not None:  # the grammar says where the output ends
        raise ProtocolError(ErrorCode.BAD_FIELD, "field 'min_tokens' cannot be combined with 'response_format'", rid)

    stop = _get(msg, "stop", (list, str), rid, [])
    if isinstance(stop, str):
        stop = [stop]
    if len(stop) > MAX_STOP_STRINGS or not all(
        isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LENGTH for s in stop
    ):
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"field 'stop' must be at most {MAX_STOP_STRINGS} non-empty strings of at most "
            f"{MAX_STOP_STRING_LENGTH} characters",
            rid,
        )
    n = _get(msg, "n", int, rid, 1)
    if n != 1:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"field 'n' must be 1 on the wire, got {_show(n)}: send n submits (the client library's n does)",
            rid,
        )
    stop_token_ids = _int_list(msg, "stop_token_ids", rid, MAX_STOP_TOKEN_IDS, ErrorCode.BAD_FIELD) or []
    priority = _int(msg, "priority", rid, 0, -1000, 1000)
    top_logprobs = _int(msg, "top_logprobs", rid, 0, 0, MAX_TOP_LOGPROBS)
    return Submit(
        id=rid,
        group=_group(msg, rid),
        prompt=prompt,
        tokens=tokens,
        messages=messages,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=list(stop),
        stop_token_ids=stop_token_ids,
        logprobs=bool(_get(msg, "logprobs", bool, rid, False)) or top_logprobs > 0,
        top_logprobs=top_logprobs,
        priority=priority,
        batch=bool(_get(msg, "batch", bool, rid, False)),
        tools=parse_tools(msg.get("tools"), msg.get("tool_choice"), msg.get("parallel_tool_calls"), rid),
    )


def _logit_bias(msg: dict[str, Any], rid: str) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: a map from token id (a decimal string, as JSON spells it; msgpack map keys
    are strings here too) to a bias in ``[-MAX_BIAS, MAX_BIAS]``. The vocabulary is checked later,
    once the daemon knows the model."""
    value = _get(msg, "logit_bias", dict, rid, None)
    if not value:
        return ()
    if len(value) > MAX_LOGIT_BIAS:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"field 'logit_bias' holds at most {MAX_LOGIT_BIAS} token ids", rid)
    out: dict[int, float] = {}
    for key, bias in value.items():
        ok_key = isinstance(key, str) and 0 < len(key) <= 10 and key.isascii() and key.isdigit()
        if not ok_key or int(key) > MAX_COUNT:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"field 'logit_bias' has key {_show(key)}; keys are token ids in [0, {MAX_COUNT}] written as decimal strings",
                rid,
            )
        good = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not (good and -MAX_BIAS <= bias <= MAX_BIAS):  # NaN fails the comparison, a huge int too
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"field 'logit_bias' maps {key} to {_show(bias)}; a bias is a number in [{-MAX_BIAS}, {MAX_BIAS}]",
                rid,
            )
        out[int(key)] = float(bias)
    return tuple(sorted(out.items()))


def parse_response_format(value: dict[str, Any] | None, rid: str | None) -> tuple[str, str] | None:
    """``response_format``: ``{"type": "json_object"}``, ``{"type": "json_schema", "schema": {...}}``,
    ``{"type": "regex", "pattern": "..."}``, ``{"type": "grammar", "grammar": "<lark>"}`` or
    ``{"type": "text"}`` (free text, the same as none). Whether it compiles is the daemon's check."""
    if value is None:
        return None
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in RESPONSE_FORMATS:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"field 'response_format' has type {_show(kind)}; expected one of {', '.join(RESPONSE_FORMATS)}",
            rid,
        )
    key = RESPONSE_FORMATS[kind]
    if key is None:
        return None if kind == "text" else (kind, "")
    text = value.get(key)
    if kind == "json_schema":
        if not isinstance(text, dict):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"field 'response_format' needs 'schema', a JSON schema object, got {_show(text)}",
                rid,
            )
        try:
            text = json.dumps(text, allow_nan=False)  # key order kept: a schema's property order is the output's
        except (TypeError, ValueError, RecursionError):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                "field 'response_format' needs 'schema', a JSON schema object (JSON values only)",
                rid,
            ) from None
    if not isinstance(text, str) or not 0 < len(text) <= MAX_FORMAT_CHARS:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"field 'response_format' needs '{key}', a non-empty string of at most {MAX_FORMAT_CHARS} characters",
            rid,
        )
    return kind, text


def _group(msg: dict[str, Any], rid: str) -> tuple[str, int] | None:
    """``group`` and ``group_size``: both or neither."""
    name = _get(msg, "group", str, rid, None)
    size = _int(msg, "group_size", rid, None, 1, MAX_GROUP_SIZE)
    if name is None and size is None:
        return None
    if name is None or size is None:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, "fields 'group' and 'group_size' go together; give both or neither", rid
        )
    if not 0 < len(name) <= MAX_ID_LENGTH:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"field 'group' must be 1 to {MAX_ID_LENGTH} characters", rid)
    return name, size


def parse_request(msg: dict[str, Any]) -> Request:
    """Turn a decoded map into a typed request, or raise ``ProtocolError`` saying what to fix.

    Field checks here are the ones that need no model; the daemon checks the rest (vocabulary,
    context length, max_tokens cap) once it knows the model.
    """
    rid = _id_of(msg)
    version = msg.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"field 'v' must be {PROTOCOL_VERSION} (this daemon speaks protocol {PROTOCOL_VERSION}), got {_show(version)}",
            rid,
        )
    kind = msg.get("type")
    if kind is None:
        raise ProtocolError(ErrorCode.MISSING_FIELD, "field 'type' is required", rid)
    if kind not in (MsgType.SUBMIT, MsgType.CANCEL, MsgType.HEALTH, MsgType.STATS):
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {_show(kind)}; expected one of submit, cancel, health, stats",
            rid,
        )
    if "id" not in msg:
        raise ProtocolError(ErrorCode.MISSING_FIELD, "field 'id' is required", None)
    if rid is None:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"field 'id' must be a string of 1 to {MAX_ID_LENGTH} characters", None
        )
    if kind == MsgType.SUBMIT:
        return _parse_submit(msg, rid)
    if kind == MsgType.CANCEL:
        return Cancel(rid)
    if kind == MsgType.HEALTH:
        return Health(rid)
    return Stats(rid)


def expand_n(req: Submit, n: int) -> list[Submit]:
    """``n`` sequences for one request: ``n`` submits with ids ``<id>/<i>``, declared one group so
    one prefill wave takes them all, each seeded ``seed + i`` when ``seed`` is given (else each draws
    its own). ``n == 1`` is the request itself. Raises ``ProtocolError`` naming ``n`` outside
    ``[1, MAX_N]``, or when the ids would be too long."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"field 'n' must be in [1, {MAX_N}], got {_show(n)}", req.id)
    if n == 1:
        return [req]
    if len(f"{req.id}/{n - 1}") > MAX_ID_LENGTH:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"field 'id' leaves no room for n's suffixes ('/<i>'): {MAX_ID_LENGTH} at most", req.id
        )
    s = req.sampling
    out = []
    for i in range(n):
        seed = None if s.seed is None else (s.seed + i) % (MAX_SEED + 1)
        out.append(replace(req, id=f"{req.id}/{i}", sampling=replace(s, seed=seed), group=(req.id, n)))
    return out
