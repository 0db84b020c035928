"""The engine's own request types: how to sample, and why a sequence ended.

The engine does not import the wire format (``clients.protocol``): the front end converts a
request's ``SamplingOptions`` to ``SamplingParams`` once, when it admits the request, so the wire can
change without touching the engine and the engine can be driven without a client package.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a sequence ended. The values are the wire's finish reasons, so the front end maps them one
    to one (a ``StrEnum`` compares equal to its value and crosses msgpack as a plain string)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. ``temperature == 0`` is greedy (argmax) and ignores the filters; the
    logits controls apply either way, before the pick.

    The bounds are the wire's (``clients.parse.parse_request`` checks them): temperature in
    [0, 100], top_p in (0, 1], min_p in [0, 1], top_k >= 0 (0: no top-k filter). ``seed`` makes a
    sampled request's draws reproducible whatever else the batch holds (``workers.engine.sampling``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    #: Logits controls (``workers.engine.logits_controls``): penalties, a bias per token id as
    #: ``(token_id, bias)`` pairs (pairs, not a map: a plan carries them through msgpack), the tokens
    #: before end-of-sequence may come, and whether end-of-sequence stops at all.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    #: Structured output: an llguidance grammar (``workers.api.grammar.grammar_text``) the sequence's
    #: tokens must follow; ``None``: free text.
    grammar: str | None = None

    def __post_init__(self) -> None:
        # A plan or an engine process hands the pairs back as lists: keep them tuples.
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
