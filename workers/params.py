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
    """How to pick each token. ``temperature == 0`` is greedy (argmax) and ignores the rest.

    The bounds are the wire's (``clients.protocol.parse_request`` checks them): temperature in
    [0, 100], top_p in (0, 1], min_p in [0, 1], top_k >= 0 (0: no top-k filter). ``seed`` makes a
    sampled request's draws reproducible whatever else the batch holds (``workers.sampling``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
