"""The wire format between clients and the daemon: the one place both sides import.

Every message is one ZeroMQ frame holding a msgpack map. Clients talk through a DEALER
socket, the daemon through a ROUTER socket, so the daemon sees ``[identity, payload]``.
This package imports no MLX and no ZeroMQ: it is pure data, so that a client app stays light
and the daemon's front end can validate without touching the engine. Here: the request messages
and the bounds on their fields; the version, codes and framing are in ``wire`` and importable from
here too. The checks a request map must pass are in ``parse``, the maps each side sends in
``messages``.

See ``docs/protocol.md`` for the prose version of what is defined here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clients.tools import Tools
from clients.wire import DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION, ErrorCode, FinishReason, MsgType, ProtocolError
from clients.wire import pack as pack
from clients.wire import unpack as unpack

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_BIAS",
    "MAX_COUNT",
    "MAX_FORMAT_CHARS",
    "MAX_GROUP_SIZE",
    "MAX_ID_LENGTH",
    "MAX_LOGIT_BIAS",
    "MAX_MESSAGES",
    "MAX_N",
    "MAX_PENALTY",
    "MAX_REPETITION_PENALTY",
    "MAX_SEED",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_LENGTH",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOP_LOGPROBS",
    "PENALTY_CONTEXT",
    "PROTOCOL_VERSION",
    "RESPONSE_FORMATS",
    "Cancel",
    "ErrorCode",
    "FinishReason",
    "Health",
    "MsgType",
    "ProtocolError",
    "Request",
    "SamplingOptions",
    "Stats",
    "Submit",
    "Tools",
    "pack",
    "unpack",
]


#: Ids are client-chosen strings; this bound keeps them cheap to store and log.
MAX_ID_LENGTH = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64
#: The most token ids one ``logit_bias`` may name, and the bound on each bias (OpenAI's).
MAX_LOGIT_BIAS = 1024
MAX_BIAS = 100.0
#: OpenAI's bound on the presence and frequency penalties; the repetition penalty is in (0, 10].
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0
#: The tokens (prompt included) the penalties look back over: mlx-lm's default context size.
PENALTY_CONTEXT = 20
#: The most sequences one ``n`` asks for (``expand_n``).
MAX_N = 16
MAX_MESSAGES = 1024
#: The most alternatives a token may report (``top_logprobs``), as OpenAI's API bounds it.
MAX_TOP_LOGPROBS = 20
#: The most submits one declared group may have (``Submit.group``).
MAX_GROUP_SIZE = 4096
#: The largest count or token id a request may give (``max_tokens``, ``top_k``, ``tokens``,
#: ``stop_token_ids``): an int32, so every accepted value fits msgpack, MLX and the engine whatever
#: the model; the daemon narrows ``max_tokens`` and the token ids to its caps and vocabulary later.
MAX_COUNT = 2**31 - 1
#: The largest ``seed``: the engine's random key takes a non-negative int64.
MAX_SEED = 2**63 - 1

#: The response format kinds and the key that holds each one's text (``json_object`` has none).
RESPONSE_FORMATS = {
    "text": None,
    "json_object": None,
    "json_schema": "schema",
    "regex": "pattern",
    "grammar": "grammar",
}
#: The longest schema (as JSON), regex or grammar a request may send.
MAX_FORMAT_CHARS = 65536


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class SamplingOptions:
    """How to pick each token. ``temperature == 0`` is greedy (argmax) and ignores the filters
    (``top_p``, ``top_k``, ``min_p``); the logits controls below apply either way."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    #: Logits controls, applied per sequence before sampling (greedy included), with mlx-lm's own
    #: processors over the last ``PENALTY_CONTEXT`` tokens (prompt included): OpenAI's additive
    #: presence and frequency penalties, the multiplicative repetition penalty (``None``: off) and an
    #: additive bias per token id, as ``(token_id, bias)`` pairs by id (the wire sends a map).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: End-of-sequence and ``stop_token_ids`` are impossible until this many tokens are out.
    min_tokens: int = 0
    #: The model's end-of-sequence tokens do not stop the sequence (``stop_token_ids`` still do).
    ignore_eos: bool = False
    #: Structured output as ``(kind, text)`` (``parse_response_format``): ``json_object`` (text
    #: empty), ``json_schema`` (the schema as JSON), ``regex`` or ``grammar`` (llguidance's Lark);
    #: ``None``: free text.
    response_format: tuple[str, str] | None = None

    @property
    def has_processors(self) -> bool:
        """Whether a logits processor runs for these options (``ignore_eos`` needs none)."""
        return bool(
            self.response_format is not None
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty is not None
            or self.logit_bias
            or self.min_tokens
        )


@dataclass(frozen=True)
class Submit:
    """A decode job: exactly one of ``prompt`` (text), ``tokens`` (ids) or ``messages`` (chat)."""

    id: str
    prompt: str | None = None
    tokens: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    #: Per emitted token, this many most likely tokens with their logprobs (0 to ``MAX_TOP_LOGPROBS``).
    #: Above 0 implies ``logprobs``: the parsed submit has ``logprobs`` true.
    top_logprobs: int = 0
    #: Order among the same tenant's waiting requests (higher first), capped by the tenant's ceiling.
    priority: int = 0
    #: ``(name, size)``: this submit is one of ``size`` that the sender sends together under ``name``
    #: (a name of this connection's own). An engine holding arrivals for one prefill wave starts them
    #: as soon as every held arrival belongs to a declared group that has all its members, instead of
    #: waiting for a quiet gap (``workers.engine.arrivals``); it never holds them longer for it.
    group: tuple[str, int] | None = None
    #: The sender reads ``batch`` messages: from then on the daemon may carry several events for
    #: this connection in one frame (one per engine step). Clients that never say so get one event
    #: per frame, as protocol 1 always did.
    batch: bool = False
    #: Function tools the chat template renders and the family's parser reads calls of
    #: (``clients.tools``); the answer's calls come back as ``tool_calls`` on its ``token`` events.
    tools: Tools | None = None


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Health:
    id: str


@dataclass(frozen=True)
class Stats:
    id: str


Request = Submit | Cancel | Health | Stats
