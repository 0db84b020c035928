"""Pausing a sequence: out of the decode batch with its KV cache and the token the batch had sampled
ahead for it, and back in exactly where it left, so its output is the same as if it had never
paused. ``Engine`` inherits these; the burst runner takes a sequence out and puts it back the same way.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from workers.api import Event, TopLogprobs
from workers.engine.sequences import Parked, Sequence, top_logprobs
from workers.engine.spec.runner import BurstRunner
from workers.kernels import as_float, as_int, mlxlm


class Parking:
    """``Engine``'s pause, resume and parking. The attributes and the three methods declared here are
    ``Engine``'s own."""

    _seqs: dict[int, Sequence]
    _by_uid: dict[int, Sequence]
    _gen: BatchGenerator
    runner: BurstRunner

    def emit(
        self, s: Sequence, candidates: list[int], logprobs: list[float], tops: list[TopLogprobs] | None = None
    ) -> list[Event]:
        raise NotImplementedError

    def keep_prefix(self, s: Sequence, cache: list[Any] | None, tokens: list[int] | None) -> None:
        raise NotImplementedError

    def _insert(
        self, s: Sequence, segments: list[list[int]], max_tokens: int, cache: list[Any] | None, in_cache: list[int]
    ) -> int:
        raise NotImplementedError

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
        return [] if parked is None else self.put_back(s, parked)

    def _park_paused(self) -> None:
        """Take every paused sequence that has reached decoding out of the batch (or out of its burst)."""
        for s in self._seqs.values():
            if not s.paused or s.parked is not None:
                continue
            if self.runner.holds(s):
                s.parked = self.runner.park()
            elif s.uid in mlxlm.decoding_uids(self._gen):
                s.parked = self.take_out(s)

    def take_out(self, s: Sequence) -> Parked:
        """Remove a decoding sequence from ``BatchGenerator`` with its cache and pending token."""
        pending_arr, lp_arr = mlxlm.pending_token(self._gen, s.uid)
        cache, in_cache = self._gen.remove([s.uid], return_prompt_caches=True)[s.uid]
        mx.eval(pending_arr, lp_arr)
        pending = as_int(pending_arr)
        history = list(in_cache) + [pending]
        self._by_uid.pop(s.uid, None)
        lp = as_float(lp_arr[pending]) if s.job.wants_logprobs else None
        top = top_logprobs(lp_arr[None], s.job.top_logprobs)[0] if s.job.top_logprobs > 0 else None
        return Parked(cache, history, pending, lp, top)

    def put_back(self, s: Sequence, parked: Parked) -> list[Event]:
        """Emit the pending token and put the sequence back into the batch with its cache (the
        inverse of ``take_out``; the batch then feeds the pending token as a one-token prompt)."""
        tops = None if parked.pending_top is None else [parked.pending_top]
        events = self.emit(s, [parked.pending], [parked.pending_logprob or 0.0], tops)
        if s.job.seq not in self._seqs:  # the pending token ended it
            self.keep_prefix(s, parked.cache, parked.history[:-1])
            return events
        remaining = s.job.max_tokens - s.emitted
        s.uid = self._insert(s, [[parked.pending]], remaining, parked.cache, parked.history[:-1])
        return events
