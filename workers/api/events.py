"""What goes into the engine and what comes out of it: jobs and commands in, events and signals out.

These cross the process boundary between the front end and the engine (``workers.api.wire`` converts
them), so they are plain dataclasses with no MLX import: the front end holds them without loading
the engine. ``Ready``, then events, then ``Stopped`` or ``Dead`` come out (the ``Signal``s); the
commands go in through the engine thread's inbox.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from workers.api.params import FinishReason, SamplingParams


@dataclass(frozen=True)
class Job:
    """A validated decode job. ``seq`` is the caller's handle; the engine never interprets it."""

    seq: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    received_at: float = field(default_factory=time.monotonic)
    #: The prefix cache entries this job may read and write (``prefix_cache.salt_for`` its tenant);
    #: ``None`` keeps the job out of the cache, so a caller that names no tenant shares nothing.
    cache_salt: str | None = None
    #: How many of the most likely tokens each emitted token reports with their logprobs (the wire
    #: bounds it to 0..20); above 0 implies ``logprobs``. 0 costs nothing.
    top_logprobs: int = 0
    #: The declared group this job arrived in (a name unique to its sender) and the group's size:
    #: admission starts a held wave early once every held job's group has all its members
    #: (``workers.engine.arrivals``). ``None``: undeclared.
    group: str | None = None
    group_size: int = 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


#: One token's most likely alternatives: ``(token_id, logprob)``, most likely first.
TopLogprobs = list[tuple[int, float]]


class TokenMode(StrEnum):
    """How a sequence's tokens were produced (the ``mode`` label of the generated-tokens metric)."""

    #: A ``BatchGenerator`` step.
    BATCHED = "batched"
    #: A B = 1 speculative round.
    BURST = "burst"


class StepKind(StrEnum):
    """What one engine step was (the ``kind`` label of the step-time histogram)."""

    #: A batched decode step, maybe carrying a prefill chunk too.
    DECODE = "decode"
    #: A step that only prefilled.
    PREFILL = "prefill"
    #: One round of a B = 1 burst.
    BURST_ROUND = "burst_round"


@dataclass
class Tokens:
    """New tokens for one sequence (more than one when a step produces several)."""

    seq: int
    tokens: list[int]
    logprobs: list[float] | None = None
    mode: TokenMode = TokenMode.BATCHED
    #: Per token, its job's ``top_logprobs`` most likely tokens (``None`` when it asked for none).
    top_logprobs: list[TopLogprobs] | None = None


@dataclass
class StepInfo:
    """What one engine step was and cost, for the step-time and batch-size histograms."""

    kind: StepKind
    seconds: float
    batch_size: int


@dataclass
class Timings:
    queue_s: float | None
    ttft_s: float | None
    decode_s: float | None
    total_s: float

    def as_dict(self) -> dict[str, float | None]:
        return {"queue_s": self.queue_s, "ttft_s": self.ttft_s, "decode_s": self.decode_s, "total_s": self.total_s}


@dataclass
class Finished:
    """The end of one sequence."""

    seq: int
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    error_code: str | None = None
    error_message: str | None = None


Event = Tokens | Finished | StepInfo


@dataclass(frozen=True)
class ModelInfo:
    """What the front end needs to validate a request without touching MLX."""

    name: str
    path: str
    model_type: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    #: KV-cache bytes one token of context costs (all layers, keys and values).
    kv_bytes_per_token: int = 0


@dataclass
class Ready:
    info: ModelInfo
    tokenizer: Any


@dataclass
class Stopped:
    pass


@dataclass
class Dead:
    error: str


Signal = Event | Ready | Stopped | Dead


@dataclass
class SubmitJob:
    """Start ``job`` (a command into the engine; ``clients.protocol.Submit`` is the client's request)."""

    job: Job


@dataclass
class Cancel:
    seq: int
    reason: str
    code: str | None
    message: str | None


@dataclass
class Pause:
    seq: int


@dataclass
class Resume:
    seq: int


@dataclass
class Shutdown:
    reason: str
    code: str
    message: str


Command = SubmitJob | Cancel | Pause | Resume | Shutdown
