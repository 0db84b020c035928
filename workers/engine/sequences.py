"""What the engine keeps per sequence (``Sequence``, ``Parked``), its counters, and what the burst
runner needs of the engine (``BurstHost``).

They live apart from ``workers.engine.engine`` so the burst runner can share them without importing
the engine. Jobs and events, which cross to the front end, are ``workers.api``'s.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from workers.api import Event, Job, Level, TopLogprobs
from workers.api.stats import CountersSnapshot
from workers.engine.sampling import SeededSampler
from workers.exact import CountedModel


def top_logprobs(rows: mx.array, k: int) -> list[TopLogprobs]:
    """The ``k`` most likely tokens of each log-probability row ``[n, V]``, most likely first.

    Ties are broken by the lower token id, on the device before anything is cut, so the answer
    depends on a row's values only (not on how many rows were asked together, nor on the kernel
    that selected them): a burst's verify rows and classic decode's rows give the same lists, and
    the first entry is the greedy token (``argmax`` also picks the first of equal maxima). Low
    precision rows (bf16) tie often, which is why this is not a plain ``argpartition``. The values
    are the row's own entries, so the sampled token's logprob equals its entry when it is listed.
    """
    k = min(k, rows.shape[-1])
    kth = mx.min(mx.topk(rows, k, axis=-1), axis=-1, keepdims=True)
    above = rows > kth
    tied = rows == kth
    room = k - above.astype(mx.int32).sum(axis=-1, keepdims=True)
    take = above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= room))
    # Exactly ``k`` entries are taken; ``argpartition`` brings them (keys 0) to the front.
    idx = mx.argpartition(mx.logical_not(take).astype(mx.int32), kth=k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(rows, idx, axis=-1).astype(mx.float32)
    mx.eval(idx, vals)
    ids: list[list[int]] = idx.tolist()  # type: ignore[assignment]
    lps: list[list[float]] = vals.tolist()  # type: ignore[assignment]
    return [sorted(zip(i, v), key=lambda e: (-e[1], e[0])) for i, v in zip(ids, lps)]


@dataclass
class Sequence:
    """One admitted job's state inside the engine, from admission to its end."""

    job: Job
    uid: int
    sampler: SeededSampler | None = None
    stops: frozenset[int] = frozenset()
    #: Its logits processors (``workers.engine.logits_controls``), run by ``BatchGenerator`` on its row
    #: only; empty for a request with no controls.
    processors: list[Any] = field(default_factory=list)
    prefill_started: float | None = None
    first_token: float | None = None
    emitted: int = 0
    #: Set when this sequence must not burst again (a non-trimmable cache, a failed drafter).
    no_burst: str | None = None
    #: The caller asked for no tokens until ``resume``; it takes effect once the sequence decodes.
    paused: bool = False
    #: Its state while it is paused and out of the decode batch.
    parked: Parked | None = None
    #: Prompt tokens whose KV came from the prefix cache (not prefilled).
    cached: int = 0


@dataclass
class Parked:
    """A sequence out of the decode batch with what it needs to go back in exactly where it left.

    ``BatchGenerator`` samples one step ahead, so the batch holds a ``pending`` token that is
    neither emitted nor fed to the model yet; ``history`` is the tokens in ``cache``, then ``pending``.
    """

    cache: list[Any]
    history: list[int]
    pending: int
    pending_logprob: float | None
    pending_top: TopLogprobs | None = None


@dataclass
class EngineCounters:
    """Monotonic counters, read by the stats reply (a snapshot, so no lock is needed)."""

    submitted: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    #: Every ``BatchGenerator`` step, prefill-only ones included (a decode step may carry a prefill
    #: chunk too): with ``decode_steps``, how a run's time splits.
    steps: int = 0
    step_seconds: float = 0.0
    #: The engine thread's CPU seconds inside those steps, and the times the OS gave its CPU to another
    #: thread meanwhile (``workers.engine.thread_clock``: 0 where the OS does not count them, macOS): CPU
    #: seconds near ``step_seconds`` mean the host, not the device, sets the step.
    step_cpu_seconds: float = 0.0
    step_preemptions: int = 0
    step_errors: int = 0
    peak_batch_size: int = 0
    #: Steps that ran a prefill chunk, and steps in which a sequence of the decode batch finished:
    #: requests that arrive (and so finish) spread over many steps cost a batch cache merge for each
    #: of the first and a batch filter for each of the second, in every layer.
    prefill_steps: int = 0
    finish_steps: int = 0

    def snapshot(self) -> CountersSnapshot:
        """The counters as the ``stats`` reply carries them (``stats.engine``)."""
        return {
            "submitted": self.submitted,
            "finished": self.finished,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "decode_steps": self.decode_steps,
            "decode_seconds": self.decode_seconds,
            "steps": self.steps,
            "step_seconds": self.step_seconds,
            "step_cpu_seconds": self.step_cpu_seconds,
            "step_preemptions": self.step_preemptions,
            "step_errors": self.step_errors,
            "peak_batch_size": self.peak_batch_size,
            "prefill_steps": self.prefill_steps,
            "finish_steps": self.finish_steps,
        }


class BurstHost(Protocol):
    """What the runner needs of the engine that owns the sequences and the batch."""

    counted: CountedModel

    def pinned(self, level: Level, purpose: str = "verify") -> AbstractContextManager[None]: ...

    def live(self) -> list[Sequence]: ...

    def decoding(self, s: Sequence) -> bool: ...

    def cache_of(self, s: Sequence) -> list[Any]: ...

    def admitted(self, s: Sequence) -> bool: ...

    def take_out(self, s: Sequence) -> Parked: ...

    def put_back(self, s: Sequence, parked: Parked) -> list[Event]: ...

    def emit(
        self, s: Sequence, candidates: list[int], logprobs: list[float], tops: list[TopLogprobs] | None = None
    ) -> list[Event]: ...

    def keep_prefix(self, s: Sequence, cache: list[Any] | None, tokens: list[int] | None) -> None: ...
