"""One batched step of the engine: a ``BatchGenerator`` step (a decode step for the batch plus a
prefill chunk), timed and counted, and its responses turned into token and finish events. ``Engine``
inherits it; the step's choice between this and a burst round is the engine's own (``Engine.step``).
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from workers.api import Event, Finished, FinishReason, Level, StepInfo, StepKind, TokenMode, Tokens, TopLogprobs
from workers.engine import faults, thread_clock
from workers.engine.prefill_pace import PrefillPace, forwarded_rows, step_chunk
from workers.engine.prefill_wave import wave_size
from workers.engine.sequences import EngineCounters, Sequence, top_logprobs
from workers.engine.spec.runner import BurstRunner
from workers.exact import PinLedger, bucket, unpinned
from workers.kernels import mlxlm, process_level

log = logging.getLogger("mlx_batchd.engine")


class BatchStep:
    """``Engine``'s batched step. The attributes and the methods declared for the type checker are
    ``Engine``'s own."""

    _by_uid: dict[int, Sequence]
    _gen: BatchGenerator
    counters: EngineCounters
    decode_seconds_by_batch: dict[int, float]
    ledger: PinLedger
    pace: PrefillPace
    prefill_batch: int
    prefill_step: int
    prefill_tokens: int
    runner: BurstRunner

    if TYPE_CHECKING:

        def pinned(self, level: Level, purpose: str = "verify") -> AbstractContextManager[None]: ...

        def batch_size(self) -> int: ...

        def keep_prefix(self, s: Sequence, cache: list[Any] | None, tokens: list[int] | None) -> None: ...

        def _place_followers(self) -> None: ...

        def _finish(self, s: Sequence, reason: FinishReason, code: str | None, message: str | None) -> Finished: ...

    def _step(self) -> list[Event]:
        tic = time.perf_counter()
        self._place_followers()
        batch = mlxlm.decode_batch_size(self._gen)
        decoding = batch > 0
        solo = mlxlm.decode_batch_size(self._gen) == 1 and not mlxlm.prefill_pending(self._gen)
        # Batched work never sees a scoped pin; the lone sequence's classic step runs at the
        # verdict's rung when that rung pins classic decode too (``padded``).
        chain = self.runner.chain_level() if solo else None
        prefill = mlxlm.prefill_pending(self._gen)
        if prefill:
            self._size_prefill(batch)
        clock = thread_clock.read()
        rows, began = forwarded_rows(self.ledger), self.pace.clock()
        with unpinned("serving") if chain is None else self.pinned(chain, "classic"):
            prompt_responses, gen_responses = self._gen.next()
        rows = forwarded_rows(self.ledger) - rows
        if prefill and rows > batch:  # it prefilled: its speed sizes the next steps (``prefill_pace``)
            self.pace.record(rows, self.pace.clock() - began)
        used = thread_clock.read()
        now = time.monotonic()
        level = process_level()
        if level is not Level.WIDE:
            self.ledger.record_seconds(level, "serving", False, time.perf_counter() - tic)
        self.counters.peak_batch_size = max(self.counters.peak_batch_size, self.batch_size())
        self.counters.steps += 1
        self.counters.step_seconds += time.perf_counter() - tic
        self.counters.step_cpu_seconds += used.cpu_seconds - clock.cpu_seconds
        self.counters.step_preemptions += used.preemptions - clock.preemptions
        if decoding:
            self.counters.decode_steps += 1
            self.counters.decode_seconds += time.perf_counter() - tic
            by_batch, key = self.decode_seconds_by_batch, bucket(batch)
            by_batch[key] = by_batch.get(key, 0.0) + time.perf_counter() - tic
            if solo and not prompt_responses:
                self.runner.classic_began(tic)
        self.counters.prefill_steps += bool(prompt_responses)
        self.counters.finish_steps += any(r.finish_reason is not None for r in gen_responses)
        for pr in prompt_responses:
            s = self._by_uid.get(pr.uid)
            if s is not None and s.prefill_started is None:
                s.prefill_started = now
        events: list[Event] = [
            StepInfo(StepKind.DECODE if decoding else StepKind.PREFILL, time.perf_counter() - tic, len(gen_responses))
        ]
        tops = self._batched_tops(gen_responses)
        for r in gen_responses:
            s = self._by_uid.get(r.uid)
            if s is None:
                continue
            try:
                events += self._respond(s, r, now, tops.get(r.uid))
                if r.finish_reason is not None:  # mlx-lm hands over the ended sequence's cache and tokens
                    self.keep_prefix(s, r.prompt_cache, r.all_tokens)
            except Exception as exc:  # this request's own failure: it ends, the batch goes on
                log.exception("request seq %d failed in the engine", s.job.seq)
                self._gen.remove([s.uid])
                events.append(
                    self._finish(s, FinishReason.ERROR, "engine_error", f"this request failed in the engine: {exc}")
                )
        return events

    def _size_prefill(self, decoding: int) -> None:
        """Size the next prefill step: its wave by tokens (``prefill_wave``) within a budget that
        the measured speed keeps within the step's target time (``prefill_pace``), and, where that
        budget binds, each prompt's chunk to its share of it."""
        prefilling, queued = mlxlm.prefill_lengths(self._gen)
        budget = self.pace.budget(self.prefill_tokens, decoding)
        step = self.prefill_step if budget >= self.prefill_tokens else min(self.prefill_step, budget)
        size = wave_size(prefilling, queued, self.prefill_batch, budget, step)
        self._gen.prefill_batch_size = size
        self._gen.prefill_step_size = step if step == self.prefill_step else step_chunk(budget, size, step)

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

    def _respond(self, s: Sequence, r: Any, now: float, top: TopLogprobs | None = None) -> list[Event]:
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
            events.append(Tokens(s.job.seq, [r.token], lp, TokenMode.BATCHED, None if top is None else [top]))
            s.emitted += 1
            self.counters.generated_tokens += 1
        if r.finish_reason is not None:
            events.append(self._finish(s, FinishReason(r.finish_reason), None, None))
        return events
