"""The batched decode engine: continuous batching on mlx-lm's ``BatchGenerator``.

The engine is single-threaded by contract: one thread (``workers.loop.EngineThread``) owns it
and every MLX object in it. It speaks in plain dataclasses (jobs in, events out) and knows
nothing of sockets, so it can be driven directly by tests and benchmarks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from workers import fastpath, faults, mlxlm
from workers.arrays import as_float, as_int
from workers.burst import (
    Adaptive,
    Auditor,
    BurstCounters,
    BurstSeq,
    BurstSettings,
    emit_in_order,
)
from workers.drafters import Drafter
from workers.kernels import Level, bytes_equal, process_level, set_process_level
from workers.params import FinishReason, SamplingParams
from workers.pins import CountedModel, PinLedger, pinned, unpinned
from workers.prefix_cache import PrefixCache
from workers.probe import Verdict, failed_verdict
from workers.sampling import SeededSampler, make_sampler
from workers.speculative import accept_greedy, accept_sampled

log = logging.getLogger("mlx_batchd.engine")

PinScope = Literal["scoped", "process"]


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

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


#: One token's most likely alternatives: ``(token_id, logprob)``, most likely first.
TopLogprobs = list[tuple[int, float]]


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
class Tokens:
    """New tokens for one sequence (more than one when a step produces several)."""

    seq: int
    tokens: list[int]
    logprobs: list[float] | None = None
    #: "batched" (a BatchGenerator step) or "burst" (a speculative round).
    mode: str = "batched"
    #: Per token, its job's ``top_logprobs`` most likely tokens (``None`` when it asked for none).
    top_logprobs: list[TopLogprobs] | None = None


@dataclass
class StepInfo:
    """What one engine step was and cost, for the step-time and batch-size histograms."""

    kind: str  # "decode" (a batched decode step, maybe with a prefill chunk), "prefill", "burst_round"
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


@dataclass
class ProbeState:
    name: str
    steps: Generator[str, None, Verdict]
    label: str = "starting"


@dataclass
class _Sequence:
    job: Job
    uid: int
    sampler: SeededSampler | None = None
    stops: frozenset[int] = frozenset()
    prefill_started: float | None = None
    first_token: float | None = None
    emitted: int = 0
    #: Set when this sequence must not burst again (a non-trimmable cache, a failed drafter).
    no_burst: str | None = None
    #: The caller asked for no tokens until ``resume``; it takes effect once the sequence decodes.
    paused: bool = False
    #: Its state while it is paused and out of the decode batch.
    parked: _Parked | None = None
    #: Prompt tokens whose KV came from the prefix cache (not prefilled).
    cached: int = 0


@dataclass
class _Parked:
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
        self.drafter: Drafter | None = None
        self.burst_settings = BurstSettings()
        self.pairing: str | None = None
        self.revoked: dict[str, str] = {}
        self.bursts = BurstCounters()
        self.adaptive = Adaptive(self.burst_settings)
        self._auditor = Auditor(0.0, 0)
        self._burst: BurstSeq | None = None
        self._last_decline: tuple[int, str] | None = None
        self.last_tax: dict[str, Any] = {}
        self._seqs: dict[int, _Sequence] = {}  # by caller seq
        self._by_uid: dict[int, _Sequence] = {}
        #: Set by the engine thread (``prefix_cache.checked``); ``None``: every prompt is prefilled whole.
        self.prefix_cache: PrefixCache | None = None
        self._gen = self._new_generator()
        fastpath.calibrate(model)  # where the backend's policy asks for it (MLX CUDA): about a second

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
        """Whether a step has anything to do: a sequence that is not parked (paused out of the batch)."""
        return any(s.parked is None for s in self._seqs.values())

    @property
    def active(self) -> int:
        """Sequences admitted and not finished (queued for prefill, prefilling, decoding or paused)."""
        return len(self._seqs)

    @property
    def paused(self) -> int:
        """Sequences paused by the caller (parked, or still prefilling and parked once they decode)."""
        return sum(1 for s in self._seqs.values() if s.paused)

    def _live(self) -> list[_Sequence]:
        """The sequences that want tokens: every one not paused."""
        return [s for s in self._seqs.values() if not s.paused]

    def batch_size(self) -> int:
        """Sequences in the decode batch right now."""
        return mlxlm.decode_batch_size(self._gen)

    # ------------------------------------------------------------------ commands

    def submit(self, job: Job) -> None:
        stops = frozenset((*self.eos_token_ids, *job.stop_token_ids))
        seq = _Sequence(job=job, uid=-1, sampler=make_sampler(job.sampling, self.vocab_size), stops=stops)
        hit = None if self.prefix_cache is None else self.prefix_cache.lookup(job.cache_salt, job.prompt)
        if hit is None or hit.cache is None:
            seq.uid = self._insert(seq, [job.prompt], job.max_tokens, None, [])
        else:  # only the suffix is prefilled, on a private copy of the cached prefix's KV
            seq.cached = len(hit.cached)
            seq.uid = self._insert(seq, [hit.rest], job.max_tokens, hit.cache, hit.cached)
        self._seqs[job.seq] = seq
        self.counters.submitted += 1

    def _keep_prefix(self, s: _Sequence, cache: list[Any] | None, tokens: list[int] | None) -> None:
        """Offer an ending sequence's KV (of exactly ``tokens``) to the prefix cache; a failure here
        costs the cache an entry, never the request."""
        pc = self.prefix_cache
        if pc is None or cache is None or tokens is None or len(tokens) <= s.cached:
            return
        try:
            pc.store(s.job.cache_salt, list(tokens), cache)
        except Exception:
            log.exception("could not keep request seq %d's KV in the prefix cache", s.job.seq)

    def _keep_burst(self, b: BurstSeq) -> None:
        """A burst's cache, kept only under an exact, unrevoked verdict (its KV came from verify forwards)."""
        verdict = None if self.pairing is None else self.verdicts.get(self.pairing)
        if verdict is not None and verdict.exact and self.pairing not in self.revoked:
            self._keep_prefix(b.seq, b.cache, b.history[:-1])

    def _insert(
        self, s: _Sequence, segments: list[list[int]], max_tokens: int, cache: list[Any] | None, in_cache: list[int]
    ) -> int:
        """Put a sequence into ``BatchGenerator`` (new, or back from a burst with its cache)."""
        # ``None`` is the batch's shared greedy sampler (mlx-lm's annotation omits it).
        samplers: list[Any] = [s.sampler]
        (uid,) = self._gen.insert_segments(
            [segments],
            max_tokens=[max_tokens],
            caches=None if cache is None else [cache],
            all_tokens=[in_cache],
            samplers=samplers,
            stop_sequences=[StopSequences([(t,) for t in sorted(s.stops)])],
        )
        self._by_uid[uid] = s
        return uid

    def cancel(
        self, seq: int, reason: str = "cancelled", code: str | None = None, message: str | None = None
    ) -> list[Event]:
        """Remove a sequence wherever it is (queued, prefilling, decoding) and free its cache."""
        s = self._seqs.get(seq)
        if s is None:
            return []
        why = FinishReason(reason)
        keep = why is not FinishReason.ERROR  # a failed step or a shutdown leaves nothing worth keeping
        if self._burst is not None and self._burst.seq is s:
            if keep:
                self._keep_burst(self._burst)
            self._end_burst()
        elif s.parked is None:
            if keep:
                self._keep_in_generator(s)
            self._gen.remove([s.uid])
        elif keep:
            self._keep_prefix(s, s.parked.cache, s.parked.history[:-1])
        return [self._finish(s, why, code, message)]

    def _keep_in_generator(self, s: _Sequence) -> None:
        """Offer the KV of a sequence still in ``BatchGenerator`` (queued, prefilling or decoding)."""
        if self.prefix_cache is None:
            return
        try:
            cache, tokens = self._gen.extract_cache([s.uid]).get(s.uid, (None, None))
        except Exception:
            log.exception("could not extract request seq %d's KV for the prefix cache", s.job.seq)
            return
        self._keep_prefix(s, cache, tokens)

    def cancel_all(self, reason: str, code: str | None = None, message: str | None = None) -> list[Event]:
        return [e for seq in list(self._seqs) for e in self.cancel(seq, reason, code, message)]

    def pause(self, seq: int) -> list[Event]:
        """Stop producing tokens for ``seq`` until ``resume``, keeping its KV cache and pending token.

        A decoding sequence leaves the batch at once (a bursting one ends its burst first); one still
        queued or prefilling finishes its prefill and leaves as soon as it reaches the decode batch.
        A paused sequence costs no decode work. Unknown sequences are ignored. Never emits tokens.
        """
        s = self._seqs.get(seq)
        if s is None or s.paused:
            return []
        s.paused = True
        self._park_paused()
        return []

    def resume(self, seq: int) -> list[Event]:
        """Undo ``pause``: the pending token is emitted now and the sequence rejoins the batch with its
        cache, so its output is the same as if it had never paused. Unknown sequences are ignored."""
        s = self._seqs.get(seq)
        if s is None or not s.paused:
            return []
        s.paused = False
        parked, s.parked = s.parked, None
        return [] if parked is None else self._put_back(s, parked)

    def _park_paused(self) -> None:
        """Take every paused sequence that has reached decoding out of the batch (or out of its burst)."""
        for s in self._seqs.values():
            if not s.paused or s.parked is not None:
                continue
            b = self._burst
            if b is not None and b.seq is s:
                self._end_burst()
                s.parked = _Parked(b.cache, b.history, b.pending, b.pending_logprob, b.pending_top)
            elif s.uid in mlxlm.decoding_uids(self._gen):
                s.parked = self._take_out(s)

    def _take_out(self, s: _Sequence) -> _Parked:
        """Remove a decoding sequence from ``BatchGenerator`` with its cache and pending token."""
        pending_arr, lp_arr = mlxlm.pending_token(self._gen, s.uid)
        cache, in_cache = self._gen.remove([s.uid], return_prompt_caches=True)[s.uid]
        mx.eval(pending_arr, lp_arr)
        pending = as_int(pending_arr)
        history = list(in_cache) + [pending]
        self._by_uid.pop(s.uid, None)
        lp = as_float(lp_arr[pending]) if s.job.wants_logprobs else None
        top = top_logprobs(lp_arr[None], s.job.top_logprobs)[0] if s.job.top_logprobs > 0 else None
        return _Parked(cache, history, pending, lp, top)

    def _put_back(self, s: _Sequence, parked: _Parked) -> list[Event]:
        """Emit the pending token and put the sequence back into the batch with its cache (the
        inverse of ``_take_out``; the batch then feeds the pending token as a one-token prompt)."""
        tops = None if parked.pending_top is None else [parked.pending_top]
        events = self._emit(s, [parked.pending], [parked.pending_logprob or 0.0], tops)
        if s.job.seq not in self._seqs:  # the pending token ended it
            self._keep_prefix(s, parked.cache, parked.history[:-1])
            return events
        remaining = s.job.max_tokens - s.emitted
        s.uid = self._insert(s, [[parked.pending]], remaining, parked.cache, parked.history[:-1])
        return events

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Event]:
        """One ``BatchGenerator`` step: a decode step for the batch plus a prefill chunk.

        A failure inside the step leaves the generator's state unknown, so every sequence in
        it ends with ``engine_error`` and a fresh generator takes over; the engine lives on.
        """
        try:
            events = self._burst_or_step()
            self._park_paused()
            return events
        except Exception as exc:  # one broken step must not take the daemon down
            self.counters.step_errors += 1
            log.exception("engine step failed")
            message = f"the engine failed this step: {exc!r}"
            in_step = [seq for seq, s in self._seqs.items() if s.parked is None]  # parked ones keep their caches
            events = [e for seq in in_step for e in self.cancel(seq, "error", "engine_error", message)]
            self._end_burst()
            self._gen = self._new_generator()
            return events

    def _step(self) -> list[Event]:
        tic = time.perf_counter()
        decoding = mlxlm.decode_batch_size(self._gen) > 0
        solo = mlxlm.decode_batch_size(self._gen) == 1 and not self._prefill_pending()
        with unpinned("serving"):  # batched work never sees a scoped pin
            prompt_responses, gen_responses = self._gen.next()
        now = time.monotonic()
        level = process_level()
        if level is not Level.WIDE:
            self.ledger.record_seconds(level, "serving", False, time.perf_counter() - tic)
        self.counters.peak_batch_size = max(self.counters.peak_batch_size, self.batch_size())
        self.counters.steps += 1
        self.counters.step_seconds += time.perf_counter() - tic
        if decoding:
            self.counters.decode_steps += 1
            self.counters.decode_seconds += time.perf_counter() - tic
            if solo and not prompt_responses:
                self.adaptive.observe_classic(time.perf_counter() - tic)
        for pr in prompt_responses:
            s = self._by_uid.get(pr.uid)
            if s is not None and s.prefill_started is None:
                s.prefill_started = now
        events: list[Event] = [
            StepInfo("decode" if decoding else "prefill", time.perf_counter() - tic, len(gen_responses))
        ]
        tops = self._batched_tops(gen_responses)
        for r in gen_responses:
            s = self._by_uid.get(r.uid)
            if s is None:
                continue
            try:
                events += self._respond(s, r, now, tops.get(r.uid))
                if r.finish_reason is not None:  # mlx-lm hands over the ended sequence's cache and tokens
                    self._keep_prefix(s, r.prompt_cache, r.all_tokens)
            except Exception as exc:  # this request's own failure: it ends, the batch goes on
                log.exception("request seq %d failed in the engine", s.job.seq)
                self._gen.remove([s.uid])
                events.append(
                    self._finish(s, FinishReason.ERROR, "engine_error", f"this request failed in the engine: {exc}")
                )
        return events

    def _batched_tops(self, responses: list[Any]) -> dict[int, TopLogprobs]:
        """The top logprobs of this step's tokens for the sequences that asked (by uid), in one
        selection over their rows; nothing is computed when none asked."""
        asking: list[tuple[int, int, mx.array]] = []
        for r in responses:
            s = self._by_uid.get(r.uid)
            if s is not None and s.job.top_logprobs > 0 and r.finish_reason != "stop":
                asking.append((r.uid, s.job.top_logprobs, r.logprobs))
        if not asking:
            return {}
        rows = top_logprobs(mx.stack([row for _, _, row in asking]), max(k for _, k, _ in asking))
        # Rows are in a canonical order (value, then id), so a prefix is that row's own top k.
        return {uid: row[:k] for (uid, k, _), row in zip(asking, rows)}

    def _respond(self, s: _Sequence, r: Any, now: float, top: TopLogprobs | None = None) -> list[Event]:
        """One sequence's share of a batched step: its token, its end."""
        faults.check_request(s.job.prompt)
        events: list[Event] = []
        if s.prefill_started is None:
            s.prefill_started = now
        if s.first_token is None:
            s.first_token = now
        # A stop token ends the sequence and is not part of the output (as in mlx-lm).
        if r.finish_reason != "stop":
            lp = [r.logprobs[r.token].item()] if s.job.wants_logprobs else None
            events.append(Tokens(s.job.seq, [r.token], lp, "batched", None if top is None else [top]))
            s.emitted += 1
            self.counters.generated_tokens += 1
        if r.finish_reason is not None:
            events.append(self._finish(s, FinishReason(r.finish_reason), None, None))
        return events

    def _finish(self, s: _Sequence, reason: FinishReason, code: str | None, message: str | None) -> Finished:
        del self._seqs[s.job.seq]
        self._by_uid.pop(s.uid, None)
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

    # ------------------------------------------------------------------ bursts

    def configure_bursts(self, drafter: Drafter, settings: BurstSettings, pairing: str) -> None:
        """Enable B = 1 bursts with ``drafter``; they run once ``pairing`` has a usable verdict."""
        self.drafter = drafter
        self.burst_settings = settings
        self.pairing = pairing
        self.adaptive = Adaptive(settings)
        self._auditor = Auditor(settings.audit_fraction, settings.seed)

    def _prefill_pending(self) -> bool:
        return mlxlm.prefill_pending(self._gen)

    def _verdict_level(self) -> tuple[Level | None, str | None]:
        """The verify level, or why there is none."""
        if self.pairing is None:
            return None, "no_drafter"
        if self.pairing in self.revoked:
            return None, "revoked"
        verdict = self.verdicts.get(self.pairing)
        if verdict is None:
            return None, "probing"
        if verdict.level is None:
            return None, "verdict_declined"
        return Level(verdict.level), None

    def _burst_refusal(self) -> tuple[_Sequence | None, str | None]:
        live = self._live()  # paused sequences do not contend
        if len(live) != 1:
            return None, "contention" if len(live) > 1 else None
        (s,) = live
        if s.uid not in mlxlm.decoding_uids(self._gen) or self._prefill_pending():
            return None, None  # still prefilling: nothing to decide yet
        if s.no_burst:
            return s, s.no_burst
        _, why = self._verdict_level()
        if why is not None:
            return s, why
        return s, self.adaptive.refusal(time.perf_counter())

    def _note_decline(self, s: _Sequence | None, reason: str) -> None:
        """Count a declined burst once per (sequence, reason) episode, not once per step."""
        key = (-1 if s is None else s.job.seq, reason)
        if key != self._last_decline:
            self._last_decline = key
            self.bursts.declined[reason] = self.bursts.declined.get(reason, 0) + 1

    def _burst_or_step(self) -> list[Event]:
        events: list[Event] = []
        if self._burst is not None:
            if len(self._live()) == 1:
                return self._round()
            self.bursts.interrupted += 1
            self._note_decline(self._burst.seq, "contention")
            events += self._rejoin()
        elif self.drafter is not None:
            s, why = self._burst_refusal()
            if why is not None:
                if why not in ("no_drafter",):
                    self._note_decline(s, why)
            elif s is not None and self._start_burst(s):
                return self._round()
        return events + self._step()

    def _start_burst(self, s: _Sequence) -> bool:
        cache, _ = self._gen.extract_cache([s.uid])[s.uid]
        if not can_trim_prompt_cache(cache):
            s.no_burst = "not_trimmable"
            self._note_decline(s, s.no_burst)
            return False
        p = self._take_out(s)
        self._burst = BurstSeq(
            s, p.cache, p.history, p.pending, p.pending_logprob, s.sampler, s.stops, pending_top=p.pending_top
        )
        assert self.drafter is not None
        try:
            self.drafter.start(p.history)
        except Exception:
            log.exception("drafter failed to start; sequence %d decodes classic", s.job.seq)
            s.no_burst = "drafter_error"
            self._rejoin()
            return False
        self.bursts.bursts += 1
        return True

    def _end_burst(self) -> None:
        if self._burst is not None and self.drafter is not None:
            self.drafter.stop()
        self._burst = None

    def _rejoin(self) -> list[Event]:
        """End the burst: emit the pending token and put the sequence back into the batch with its cache."""
        b = self._burst
        assert b is not None
        self._end_burst()
        return self._put_back(b.seq, _Parked(b.cache, b.history, b.pending, b.pending_logprob, b.pending_top))

    def _emit(
        self, s: _Sequence, candidates: list[int], logprobs: list[float], tops: list[TopLogprobs] | None = None
    ) -> list[Event]:
        """Emit what classic decode would of ``candidates`` (``tops``: their top logprobs, if asked)."""
        tokens, lps, finish = emit_in_order(candidates, logprobs, s.emitted, s.job.max_tokens, s.stops)
        events: list[Event] = []
        if tokens:
            if s.first_token is None:
                s.first_token = time.monotonic()
            mode = "burst" if self._burst is not None and self._burst.seq is s else "batched"
            top = None if tops is None else tops[: len(tokens)]  # what is emitted is a prefix of candidates
            events.append(Tokens(s.job.seq, tokens, lps if s.job.wants_logprobs else None, mode, top))
            s.emitted += len(tokens)
            self.counters.generated_tokens += len(tokens)
        if finish is not None:
            if self._burst is not None and self._burst.seq is s:
                self._keep_burst(self._burst)
                self._end_burst()
            events.append(self._finish(s, finish, None, None))
        return events

    def _verify(self, b: BurstSeq, block: list[int], level: Level) -> tuple[mx.array, mx.array | None]:
        """The verify forward: one block, pinned to ``level`` (a lone token is a plain step).
        Returns the logits rows and, for drafters that need them, the hidden states."""
        scope = unpinned("verify") if len(block) == 1 else self.pinned(level, "verify")
        hidden = None
        with scope:
            inputs = mx.array([block])
            if self.drafter is not None and self.drafter.needs_hidden:
                logits, hidden = self.counted.with_hidden(inputs, b.cache)
                mx.eval(logits, hidden)
            else:
                logits = self.counted(inputs, cache=b.cache)
                mx.eval(logits)
        return logits[0], hidden

    def _round(self) -> list[Event]:
        b = self._burst
        assert b is not None and self.drafter is not None
        level, why = self._verdict_level()
        if level is None:  # revoked or re-probed away while bursting
            self._note_decline(b.seq, why or "revoked")
            return self._rejoin()
        s = b.seq
        tic = time.perf_counter()
        try:
            draft = self.drafter.propose(self.burst_settings.k, b.sampler)
        except Exception:
            log.exception("drafter failed mid-burst; sequence %d decodes classic", s.job.seq)
            s.no_burst = "drafter_error"
            return self._rejoin()
        block = [b.pending, *draft.tokens]
        audit = self._auditor.pick() and len(block) > 1
        single = None
        if audit:
            with unpinned("audit"):
                single = self.counted(mx.array([[b.pending]]), cache=b.cache)[0, 0]
                mx.eval(single)
            trim_prompt_cache(b.cache, 1)
        logits, hidden = self._verify(b, block, level)
        self.bursts.rounds += 1
        self.bursts.drafted += len(draft.tokens)
        if single is not None:
            self.bursts.audits += 1
            if not bytes_equal(single, logits[0]):
                return self._revoke(b, len(block), level)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if b.sampler is None:
            outcome = accept_greedy(draft.tokens, logits)
        else:
            outcome = accept_sampled(draft.tokens, draft.q, logprobs, b.sampler)
        a = outcome.accepted
        self.bursts.accepted += a
        trim_prompt_cache(b.cache, len(draft.tokens) - a)
        candidates = [b.pending, *draft.tokens[:a]]
        lps = [b.pending_logprob or 0.0]
        if s.job.wants_logprobs:
            lps += [as_float(logprobs[j, draft.tokens[j]]) for j in range(a)]
            b.pending_logprob = as_float(logprobs[a, outcome.next_token])
        else:
            lps += [0.0] * a
        tops: list[TopLogprobs] | None = None
        if s.job.top_logprobs > 0 and b.pending_top is not None:
            # Row j of the verify is the distribution of candidate j + 1; row a that of the new pending.
            rows = top_logprobs(logprobs[: a + 1], s.job.top_logprobs)
            tops, b.pending_top = [b.pending_top, *rows[:a]], rows[a]
        b.history += [*draft.tokens[:a], outcome.next_token]
        b.pending = outcome.next_token
        events = self._emit(s, candidates, lps, tops)
        self.bursts.emitted += sum(len(e.tokens) for e in events if isinstance(e, Tokens))
        if s.job.seq not in self._seqs:
            return events
        try:
            self.drafter.commit(a, b.history, hidden)
        except Exception:
            log.exception("drafter failed mid-burst; sequence %d decodes classic", s.job.seq)
            s.no_burst = "drafter_error"
            return events + self._rejoin()
        self.adaptive.observe_round(time.perf_counter() - tic, len(candidates))
        events.append(StepInfo("burst_round", time.perf_counter() - tic, 1))
        if not self.adaptive.after_round(time.perf_counter()):
            self._note_decline(s, "adaptive")
            events += self._rejoin()
        return events

    def _revoke(self, b: BurstSeq, block_len: int, level: Level) -> list[Event]:
        """The audit caught the verify disagreeing with classic decode: fail closed for good."""
        assert self.pairing is not None
        self.bursts.audit_failures += 1
        reason = (
            f"audit: verify at {level.value} differs from a single-token forward at position 0 "
            f"(request seq {b.seq.job.seq}, context {len(b.history) - 1} tokens)"
        )
        self.revoked[self.pairing] = reason
        log.warning("revoking the verdict for %s: %s", self.pairing, reason)
        trim_prompt_cache(b.cache, block_len)  # drop the whole unverified block
        return self._rejoin()

    def burst_summary(self) -> dict[str, Any]:
        return {
            "drafter": None if self.drafter is None else self.drafter.name,
            "k": self.burst_settings.k,
            "active": self._burst is not None,
            "bursts": self.bursts.bursts,
            "rounds": self.bursts.rounds,
            "drafted_tokens": self.bursts.drafted,
            "accepted_tokens": self.bursts.accepted,
            "emitted_tokens": self.bursts.emitted,
            "interrupted": self.bursts.interrupted,
            "declined": dict(self.bursts.declined),
            "audits": self.bursts.audits,
            "audit_failures": self.bursts.audit_failures,
            "revoked": dict(self.revoked),
            "speedup_estimate": self.adaptive.speedup,
            "classic_step_s": self.adaptive.classic_step_s,
            "round_s": self.adaptive.round_s,
        }

    # ------------------------------------------------------------------ the pin's tax

    def measure_tax(self, batch: int, level: Level, reps: int = 3, context: int = 32) -> dict[str, Any]:
        """Time one batched decode step at ``level`` vs wide, at ``batch`` sequences, on scratch
        caches (serving state is untouched): what a process-wide pin would cost this batch."""
        batch = max(1, batch)
        caches = []
        for i in range(batch):
            c = make_prompt_cache(self.model)
            self.model(mx.array([[(7 * i + j) % self.vocab_size for j in range(context)]]), cache=c)
            caches.append(c)
        merged = mlxlm.merge_caches(caches)
        mx.eval([c.state for c in merged])
        step = mx.array([[1]] * batch)
        times: dict[str, list[float]] = {"wide": [], "pinned": []}
        for _ in range(reps + 1):
            for name, lv in (("wide", Level.WIDE), ("pinned", level)):
                tic = time.perf_counter()
                with pinned(self.ledger, lv, "tax"):
                    mx.eval(self.counted(step, cache=merged))
                times[name].append(time.perf_counter() - tic)
        wide = sorted(times["wide"][1:])[reps // 2]
        pin = sorted(times["pinned"][1:])[reps // 2]
        self.last_tax = {
            "batch": batch,
            "level": level.value,
            "wide_step_s": wide,
            "pinned_step_s": pin,
            "ratio": pin / wide,
            "measured_at": time.time(),
        }
        return self.last_tax

    def tax_summary(self) -> dict[str, Any]:
        """The last measurement and what scoping saved: the batched decode seconds so far would
        each have cost ``ratio`` times as much under a process-wide pin."""
        if not self.last_tax:
            return {}
        saved = 0.0 if self.pin_scope == "process" else (self.last_tax["ratio"] - 1.0) * self.counters.decode_seconds
        return {**self.last_tax, "estimated_seconds_saved_by_scoping": saved}
