"""The batched decode engine: continuous batching on mlx-lm's ``BatchGenerator``.

The engine is single-threaded by contract: one thread (``workers.engine.loop.EngineThread``) owns it
and every MLX object in it. It speaks in plain dataclasses (jobs in, events out) and knows
nothing of sockets, so it can be driven directly by tests and benchmarks.

Its one idea is a sequence's life in the batch (admit, step, pause, resume, cancel, finish, its KV
handed to the prefix cache). What it holds besides lives in its own modules: the burst runner
(``workers.engine.spec.runner``), the verdict holder (``workers.exact``; a verdict carries what a
process-wide pin would cost) and the pin ledger; ``holdings`` gives the engine's surface onto them.
The batched step itself (a ``BatchGenerator`` step, its responses to events) is ``batch_step``.
Kernel plans not stored yet are timed in the constructor, or (``calibration="background"``, the
daemon) between steps by ``background`` while the engine serves without them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from mlx_lm.generate import BatchGenerator, StopSequences

from workers import envs
from workers.api import (
    PREFILL_TOKENS,
    Event,
    Finished,
    FinishReason,
    Job,
    PinScope,
    Timings,
    TokenMode,
    Tokens,
    TopLogprobs,
)
from workers.api.grammar import lltokenizer
from workers.engine.background import Background
from workers.engine.batch_step import BatchStep
from workers.engine.grammar_mask import GrammarState
from workers.engine.holdings import Holdings
from workers.engine.logits_controls import processors_for, stop_ids
from workers.engine.parking import Parking
from workers.engine.prefill_pace import PrefillPace
from workers.engine.prefill_wave import most_prompts
from workers.engine.prefix_cache import PrefixCache
from workers.engine.sampling import make_sampler
from workers.engine.sequences import EngineCounters, Sequence
from workers.engine.shared_prefill import SharedPrefill
from workers.engine.spec.policy import Gate, emit_in_order
from workers.engine.spec.runner import BurstRunner
from workers.exact import CountedModel, PinLedger, Verdicts
from workers.kernels import compiled_layers, fastpath, mlxlm, plan_units
from workers.models import cache_dir

log = logging.getLogger("mlx_batchd.engine")

#: When an engine without stored kernel plans times them: before its constructor returns, or between
#: its steps (a daemon: it serves meanwhile, with none installed).
Calibration = Literal["now", "background"]


class Engine(Parking, Holdings, BatchStep):
    """Owns the model and a ``BatchGenerator``; turns jobs into token and finish events."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        max_batch: int = 32,
        prefill_batch: int | None = None,
        prefill_step: int = 2048,
        prefill_tokens: int = PREFILL_TOKENS,
        step_target_s: float = 0.0,
        lockstep: bool = False,
        calibration: Calibration = "now",
    ) -> None:
        #: ``process`` only in the bench's arm that pins the whole process (``envs.BENCH_PROCESS_PIN``).
        self.pin_scope: PinScope = "process" if envs.switch(envs.BENCH_PROCESS_PIN) else "scoped"
        #: One of several ranks stepping the same batch (``workers.engine.loop``): a failed step cannot be
        #: recovered from on one rank alone, so it raises instead (and every rank stops).
        self.lockstep = lockstep
        self.model = model
        self.ledger = PinLedger()
        #: The target as every forward sees it: counted, and wrapped for per-query attention.
        self.counted = CountedModel(model, self.ledger)
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        #: The model's tokenizer (``workers.engine.loop`` sets it): what a grammar's token masks are built from.
        self.tokenizer: Any = None
        self.max_batch = max_batch
        #: Most prompts one prefill wave takes (``None``: the decode batch's size); the wave is sized
        #: by ``prefill_tokens`` within it (``workers.engine.prefill_wave``).
        self.prefill_batch = most_prompts(prefill_batch, max_batch)
        self.prefill_step = prefill_step
        self.prefill_tokens = prefill_tokens
        #: The prefill budget that keeps a step within ``step_target_s`` at the measured speed
        #: (``workers.engine.prefill_pace``). Not in lockstep: every rank must size its steps alike,
        #: and each measures its own speed.
        self.pace = PrefillPace(0.0 if lockstep else step_target_s)
        self.counters = EngineCounters()
        self._verdicts = Verdicts(self.pin_scope)
        self.runner = BurstRunner(self, self._verdicts)
        #: Batched decode seconds by batch bucket (``workers.exact.bucket``): what scoping saved.
        self.decode_seconds_by_batch: dict[int, float] = {}
        self._seqs: dict[int, Sequence] = {}  # by caller seq
        #: Siblings of one request waiting for their leader's prefill (``workers.engine.shared_prefill``).
        self.shared = SharedPrefill()
        self._by_uid: dict[int, Sequence] = {}
        #: Set by the engine thread (``prefix_cache.checked``); ``None``: every prompt is prefilled whole.
        self.prefix_cache: PrefixCache | None = None
        self._gen = self._new_generator()
        #: Start-up work run between steps once the engine serves (``workers.engine.background``).
        self.background = Background()
        #: The row-count plans that calibration chose, by projection shape (``fastpath.plans_summary``):
        #: timed once per machine and kept (``workers.kernels.plan_store``), so every process serving the
        #: model runs the same kernels; stats carry them. Where the backend's policy asks for them (MLX
        #: CUDA), and not in lockstep: the plans come from timings, which differ per machine, and a
        #: projection every rank computes whole (the unsplit lm_head) must run the same kernel everywhere.
        self.kernel_plans: dict[str, str] = {}
        #: Seconds by phase of the start that made this engine (``ready_phases``; empty outside a daemon).
        self.ready_phases: dict[str, float] = {}
        if not lockstep:
            self._plan(model, calibration)
        #: Decoder layers registered to run as compiled halves in decode steps, which they do where the
        #: policy says so (``compiled_layers.running``); none in lockstep, whose layers hold the ranks'
        #: collectives.
        self.compiled_layers = 0 if lockstep else compiled_layers.install(model)

    def _plan(self, model: Any, calibration: Calibration) -> None:
        """Install the kernel plans (for steps of up to ``max_batch`` sequences): the stored ones, else
        timed now (``now``) or between steps (``background``: until they are, every projection runs as
        mlx-lm calls it)."""
        store = cache_dir() / "kernel-plans"
        if calibration == "now":
            self.kernel_plans = fastpath.plans_summary(plan_units.calibrate(model, store, max_batch=self.max_batch))
            return
        plans = plan_units.stored_plans(model, store, self.max_batch)
        if plans is None:
            steps = plan_units.calibration_steps(model, store, self.max_batch)
            self.background.add("kernel plans", steps, self._calibrated)
        elif plan_units.warm_rows(model, plans):
            # Their kernels compile (and the row kernel checks its shapes) between steps too.
            self.background.add("kernel plans", plan_units.warming_steps(model, plans), self._calibrated)
        elif plans:
            fastpath.install(model, plans)
            self.kernel_plans = fastpath.plans_summary(plans)

    def _calibrated(self, plans: dict[str, dict[int, int]]) -> None:
        self.kernel_plans = fastpath.plans_summary(plans)

    def reset_counters(self) -> None:
        """Start the monotonic counters from zero (after warm-up, so stats count served work only)."""
        self.counters = EngineCounters()
        self.decode_seconds_by_batch = {}

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.counted,  # type: ignore[arg-type]
            completion_batch_size=self.max_batch,
            prefill_batch_size=self.prefill_batch,
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

    def live(self) -> list[Sequence]:
        """The sequences that want tokens: every one not paused."""
        return [s for s in self._seqs.values() if not s.paused]

    def batch_size(self) -> int:
        """Sequences in the decode batch right now."""
        return mlxlm.decode_batch_size(self._gen)

    # ------------------------------------------------------------------ commands

    def submit(self, job: Job) -> None:
        stops = stop_ids(job.sampling, self.eos_token_ids, job.stop_token_ids)
        processors = processors_for(job.sampling, len(job.prompt), stops)
        sampler = make_sampler(job.sampling, self.vocab_size)
        if job.sampling.grammar is not None:  # the mask runs last: what the grammar refuses stays refused
            state = GrammarState(lltokenizer(self.tokenizer, self.vocab_size), job.sampling.grammar, stops, sampler)
            processors.append(state)  # the object itself: a burst's verify masks its rows through it
            sampler = state.sampler  # type: ignore[assignment]
        # A burst's verify runs the same processors row by row (``workers.engine.spec.controls``): they keep bursts.
        seq = Sequence(job=job, uid=-1, sampler=sampler, stops=stops, processors=processors)
        pc = self.prefix_cache
        leader = self.shared.leader_for(seq, self._seqs.values()) if pc is not None and pc.serving else None
        if leader is not None:  # a sibling of one request: it takes the leader's prompt KV (``shared_prefill``)
            self.shared.hold(leader, seq)
        else:
            self._place(seq)
        self._seqs[job.seq] = seq
        self.counters.submitted += 1

    def _place(self, seq: Sequence) -> None:
        """Put a new sequence into the batch, on the prefix cache's KV where it has the prompt's start."""
        job = seq.job
        hit = None if self.prefix_cache is None else self.prefix_cache.lookup(job.cache_salt, job.prompt)
        if hit is None or hit.cache is None:
            seq.uid = self._insert(seq, [job.prompt], job.max_tokens, None, [])
        else:  # only the suffix is prefilled, on a private copy of the cached prefix's KV
            seq.cached = len(hit.cached)
            seq.uid = self._insert(seq, [hit.rest], job.max_tokens, hit.cache, hit.cached)

    def _place_followers(self) -> None:
        """Siblings whose leader has its first token (or will not get one soon) enter the batch; the
        leader's prompt KV goes to the prefix cache first, so they prefill only the prompt's last token."""
        for leader, followers in self.shared.ready(self._seqs):
            if leader.job.seq in self._seqs and leader.first_token is not None and leader.parked is None:
                self._keep_in_generator(leader)
            for f in followers:
                self._place(f)

    def keep_prefix(self, s: Sequence, cache: list[Any] | None, tokens: list[int] | None) -> None:
        """Offer an ending sequence's KV (of exactly ``tokens``) to the prefix cache; a failure here
        costs the cache an entry, never the request."""
        pc = self.prefix_cache
        if pc is None or cache is None or tokens is None or len(tokens) <= s.cached:
            return
        try:
            pc.store(s.job.cache_salt, list(tokens), cache)
        except Exception:
            log.exception("could not keep request seq %d's KV in the prefix cache", s.job.seq)

    def _insert(
        self, s: Sequence, segments: list[list[int]], max_tokens: int, cache: list[Any] | None, in_cache: list[int]
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
            logits_processors=[s.processors],
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
        if self.shared.holds(s):  # a sibling still waiting for its leader: nothing of it is in the batch
            self.shared.drop(s)
        elif self.runner.holds(s):
            self.runner.close(keep)
        elif s.parked is None:
            if keep:
                self._keep_in_generator(s)
            self._gen.remove([s.uid])
        elif keep:
            self.keep_prefix(s, s.parked.cache, s.parked.history[:-1])
        return [self._finish(s, why, code, message)]

    def _keep_in_generator(self, s: Sequence) -> None:
        """Offer the KV of a sequence still in ``BatchGenerator`` (queued, prefilling or decoding)."""
        if self.prefix_cache is None:
            return
        try:
            cache, tokens = self._gen.extract_cache([s.uid]).get(s.uid, (None, None))
        except Exception:
            log.exception("could not extract request seq %d's KV for the prefix cache", s.job.seq)
            return
        self.keep_prefix(s, cache, tokens)

    def cancel_all(self, reason: str, code: str | None = None, message: str | None = None) -> list[Event]:
        return [e for seq in list(self._seqs) for e in self.cancel(seq, reason, code, message)]

    # ------------------------------------------------------------------ stepping

    def step(self, gate: Gate | None = None) -> list[Event]:
        """A burst round for the lone sequence when the burst runner wants one, else one
        ``BatchGenerator`` step: a decode step for the batch plus a prefill chunk. ``gate`` is the
        clock-driven part of the burst decision when another process took it (``BurstRunner.wants``).

        A failure inside the step leaves the generator's state unknown, so every sequence in
        it ends with ``engine_error`` and a fresh generator takes over; the engine lives on.
        In ``lockstep`` the failure is raised instead: the other ranks' generators went on.

        The last step is timed for the burst gate from its start to this one's (``cycle_ended``).
        """
        self.runner.cycle_ended(time.perf_counter())
        try:
            live = self.live()  # paused sequences do not contend
            if self.runner.wants(live, gate):  # burst the lone sequence
                events = self.runner.round()
            else:
                events = self.runner.interrupt(live) + self._step()
            self._park_paused()
            return events
        except Exception as exc:  # one broken step must not take the daemon down
            if self.lockstep:
                raise
            self.counters.step_errors += 1
            log.exception("engine step failed")
            message = f"the engine failed this step: {exc!r}"
            in_step = [seq for seq, s in self._seqs.items() if s.parked is None]  # parked ones keep their caches
            events = [e for seq in in_step for e in self.cancel(seq, "error", "engine_error", message)]
            self.runner.end()
            self._gen = self._new_generator()
            return events
        finally:
            if not self.has_work:  # the loop waits for work now: no part of this step
                self.runner.cycle_ended(None)

    def _finish(self, s: Sequence, reason: FinishReason, code: str | None, message: str | None) -> Finished:
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

    # ------------------------------------------------------------------ for the burst runner

    def emit(
        self, s: Sequence, candidates: list[int], logprobs: list[float], tops: list[TopLogprobs] | None = None
    ) -> list[Event]:
        """Emit what classic decode would of ``candidates`` (``tops``: their top logprobs, if asked)."""
        tokens, lps, finish = emit_in_order(candidates, logprobs, s.emitted, s.job.max_tokens, s.stops)
        events: list[Event] = []
        if tokens:
            if s.first_token is None:
                s.first_token = time.monotonic()
            mode = TokenMode.BURST if self.runner.holds(s) else TokenMode.BATCHED
            top = None if tops is None else tops[: len(tokens)]  # what is emitted is a prefix of candidates
            events.append(Tokens(s.job.seq, tokens, lps if s.job.wants_logprobs else None, mode, top))
            s.emitted += len(tokens)
            self.counters.generated_tokens += len(tokens)
        if finish is not None:
            if self.runner.holds(s):
                self.runner.close(True)
            events.append(self._finish(s, finish, None, None))
        return events

    def decoding(self, s: Sequence) -> bool:
        """Whether ``s`` is in the decode batch with no prefill pending (so a burst may take it)."""
        return s.uid in mlxlm.decoding_uids(self._gen) and not mlxlm.prefill_pending(self._gen)

    def cache_of(self, s: Sequence) -> list[Any]:
        """The KV cache of a sequence in the batch (a view: the sequence stays where it is)."""
        cache, _ = self._gen.extract_cache([s.uid])[s.uid]
        return cache

    def admitted(self, s: Sequence) -> bool:
        """Whether ``s`` has not finished."""
        return s.job.seq in self._seqs
