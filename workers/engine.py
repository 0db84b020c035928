"""The batched decode engine: continuous batching on mlx-lm's ``BatchGenerator``.

The engine is single-threaded by contract: one thread (``workers.loop.EngineThread``) owns it
and every MLX object in it. It speaks in plain dataclasses (jobs in, events out) and knows
nothing of sockets, so it can be driven directly by tests and benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from clients.protocol import SamplingOptions
from workers.kernels import Level, process_level, set_process_level
from workers.pins import CountedModel, PinLedger, pinned, unpinned
from workers.probe import Verdict, failed_verdict
from workers.sampling import make_sampler

PinScope = Literal["scoped", "process"]


@dataclass(frozen=True)
class Job:
    """A validated decode job. ``seq`` is the caller's handle; the engine never interprets it."""

    seq: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    received_at: float = field(default_factory=time.monotonic)


@dataclass
class Tokens:
    """New tokens for one sequence (more than one when a step produces several)."""

    seq: int
    tokens: list[int]
    logprobs: list[float] | None = None


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
    """The end of one sequence. ``reason`` is stop / length / cancelled / error."""

    seq: int
    reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    error_code: str | None = None
    error_message: str | None = None


Event = Tokens | Finished


@dataclass
class ProbeState:
    name: str
    steps: Generator[str, None, Verdict]
    label: str = "starting"


@dataclass
class _Sequence:
    job: Job
    uid: int
    prefill_started: float | None = None
    first_token: float | None = None
    emitted: int = 0


@dataclass
class EngineCounters:
    """Monotonic counters, read by the stats reply (a snapshot, so no lock is needed)."""

    submitted: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    step_errors: int = 0
    peak_batch_size: int = 0


class Engine:
    """Owns the model and a ``BatchGenerator``; turns jobs into token and finish events."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        max_batch: int = 32,
        prefill_batch: int = 8,
        prefill_step: int = 2048,
        pin_scope: PinScope = "scoped",
    ) -> None:
        self.pin_scope = pin_scope
        self.model = model
        self.ledger = PinLedger()
        #: The target as every forward sees it: counted, and wrapped for per-query attention.
        self.counted = CountedModel(model, self.ledger)
        self.probe_state: ProbeState | None = None
        self.verdicts: dict[str, Verdict] = {}
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_batch = max_batch
        self.prefill_batch = prefill_batch
        self.prefill_step = prefill_step
        self.counters = EngineCounters()
        self._seqs: dict[int, _Sequence] = {}  # by caller seq
        self._by_uid: dict[int, _Sequence] = {}
        self._gen = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.counted,  # type: ignore[arg-type]
            completion_batch_size=self.max_batch,
            prefill_batch_size=min(self.prefill_batch, self.max_batch),
            prefill_step_size=self.prefill_step,
        )

    # ------------------------------------------------------------------ state

    @property
    def has_work(self) -> bool:
        return bool(self._seqs)

    @property
    def active(self) -> int:
        """Sequences admitted and not finished (queued for prefill, prefilling or decoding)."""
        return len(self._seqs)

    def batch_size(self) -> int:
        """Sequences in the decode batch right now."""
        return len(self._gen._generation_batch)

    # ------------------------------------------------------------------ commands

    def submit(self, job: Job) -> None:
        stops = [(t,) for t in (*self.eos_token_ids, *job.stop_token_ids)]
        # ``None`` is the batch's shared greedy sampler (mlx-lm's annotation omits it).
        samplers: list[Any] = [make_sampler(job.sampling, self.vocab_size)]
        (uid,) = self._gen.insert(
            [job.prompt],
            max_tokens=[job.max_tokens],
            samplers=samplers,
            stop_sequences=[StopSequences(stops)],
        )
        seq = _Sequence(job=job, uid=uid)
        self._seqs[job.seq] = seq
        self._by_uid[uid] = seq
        self.counters.submitted += 1

    def cancel(
        self, seq: int, reason: str = "cancelled", code: str | None = None, message: str | None = None
    ) -> list[Event]:
        """Remove a sequence wherever it is (queued, prefilling, decoding) and free its cache."""
        s = self._seqs.get(seq)
        if s is None:
            return []
        self._gen.remove([s.uid])
        return [self._finish(s, reason, code, message)]

    def cancel_all(self, reason: str, code: str | None = None, message: str | None = None) -> list[Event]:
        return [e for seq in list(self._seqs) for e in self.cancel(seq, reason, code, message)]

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Event]:
        """One ``BatchGenerator`` step: a decode step for the batch plus a prefill chunk.

        A failure inside the step leaves the generator's state unknown, so every sequence in
        it ends with ``engine_error`` and a fresh generator takes over; the engine lives on.
        """
        try:
            return self._step()
        except Exception as exc:  # one broken step must not take the daemon down
            self.counters.step_errors += 1
            events = self.cancel_all("error", "engine_error", f"the engine failed this step: {exc!r}")
            self._gen = self._new_generator()
            return events

    def _step(self) -> list[Event]:
        tic = time.perf_counter()
        decoding = len(self._gen._generation_batch) > 0
        with unpinned("serving"):  # batched work never sees a scoped pin
            prompt_responses, gen_responses = self._gen.next()
        now = time.monotonic()
        level = process_level()
        if level is not Level.WIDE:
            self.ledger.record_seconds(level, "serving", False, time.perf_counter() - tic)
        self.counters.peak_batch_size = max(self.counters.peak_batch_size, self.batch_size())
        if decoding:
            self.counters.decode_steps += 1
            self.counters.decode_seconds += time.perf_counter() - tic
        for pr in prompt_responses:
            s = self._by_uid.get(pr.uid)
            if s is not None and s.prefill_started is None:
                s.prefill_started = now
        events: list[Event] = []
        for r in gen_responses:
            s = self._by_uid.get(r.uid)
            if s is None:
                continue
            if s.prefill_started is None:
                s.prefill_started = now
            if s.first_token is None:
                s.first_token = now
            # A stop token ends the sequence and is not part of the output (as in mlx-lm).
            if r.finish_reason != "stop":
                lp = [r.logprobs[r.token].item()] if s.job.logprobs else None
                events.append(Tokens(s.job.seq, [r.token], lp))
                s.emitted += 1
                self.counters.generated_tokens += 1
            if r.finish_reason is not None:
                events.append(self._finish(s, r.finish_reason, None, None, removed=True))
        return events

    def _finish(
        self, s: _Sequence, reason: str, code: str | None, message: str | None, removed: bool = False
    ) -> Finished:
        del self._seqs[s.job.seq]
        del self._by_uid[s.uid]
        self.counters.finished += 1
        self.counters.prompt_tokens += len(s.job.prompt) if s.prefill_started is not None else 0
        now = time.monotonic()
        t0 = s.job.received_at
        timings = Timings(
            queue_s=None if s.prefill_started is None else s.prefill_started - t0,
            ttft_s=None if s.first_token is None else s.first_token - t0,
            decode_s=None if s.first_token is None else now - s.first_token,
            total_s=now - t0,
        )
        return Finished(s.job.seq, reason, len(s.job.prompt), s.emitted, timings, code, message)

    def clear_memory(self) -> None:
        mx.clear_cache()

    # ------------------------------------------------------------------ pins and the probe

    def pinned(self, level: Level, purpose: str = "verify") -> AbstractContextManager[None]:
        """``with engine.pinned(level): logits = engine.forward(...); mx.eval(logits)``: only the
        forwards built inside the block run at ``level``; they are counted as requested."""
        return pinned(self.ledger, level, purpose)

    def forward(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """One target forward at whatever level is in force (wide unless inside ``pinned``)."""
        return self.counted(inputs, cache=cache)

    def start_probe(self, name: str, steps: Generator[str, None, Verdict]) -> None:
        """Queue a probe; ``probe_step`` advances it one draw at a time."""
        self.probe_state = ProbeState(name, steps)

    @property
    def probing(self) -> bool:
        return self.probe_state is not None

    def probe_step(self) -> Verdict | None:
        """Advance the probe by one draw; return the verdict when it is done."""
        state = self.probe_state
        if state is None:
            return None
        try:
            with unpinned("probe"):
                state.label = next(state.steps)
            return None
        except StopIteration as done:
            verdict: Verdict = done.value
        except Exception as exc:  # a probe that fails is a declined verdict, never a crash
            verdict = failed_verdict(state.name, exc)
        self.probe_state = None
        self.verdicts[state.name] = verdict
        if self.pin_scope == "process" and verdict.level is not None:
            set_process_level(Level(verdict.level))
        return verdict

    def verdict_summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: {
                "level": v.level,
                "exact": v.exact,
                "reason": v.reason,
                "probe_seconds": v.probe_seconds,
                "from_cache": v.from_cache,
            }
            for name, v in self.verdicts.items()
        }
        if self.probe_state is not None:
            out[self.probe_state.name] = {"status": "probing", "at": self.probe_state.label}
        return out
