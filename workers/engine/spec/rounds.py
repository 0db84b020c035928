"""One speculative round of a burst: draft, (maybe audit,) verify, accept, emit; and the revocation
when an audit finds the verify disagreeing with classic decode. ``BurstRunner`` inherits it; when a
round runs, and what starts and ends a burst, are the runner's own.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from workers.api import BurstSettings, Event, Level, StepInfo, StepKind, Tokens, TopLogprobs
from workers.engine.sequences import BurstHost, Sequence, top_logprobs
from workers.engine.spec.accept import accept_greedy, accept_sampled
from workers.engine.spec.drafters import Draft, Drafter, token_list
from workers.engine.spec.lookahead import Ahead, build_next, plain
from workers.engine.spec.policy import Adaptive, Auditor, BurstCounters, BurstSeq
from workers.kernels import as_float, bytes_equal

log = logging.getLogger("mlx_batchd.engine")


class Rounds:
    """``BurstRunner``'s rounds. The attributes and the methods declared for the type checker are
    ``BurstRunner``'s own."""

    host: BurstHost
    drafter: Drafter | None
    settings: BurstSettings
    pairing: str | None
    revoked: dict[str, str]
    counters: BurstCounters
    adaptive: Adaptive
    current: BurstSeq | None
    _auditor: Auditor
    _stop_asked: bool
    _ahead: Ahead | None
    _cycle: tuple[float, int, bool | None] | None

    if TYPE_CHECKING:

        def _verdict_level(self) -> tuple[Level | None, str | None]: ...

        def _classic(self, level: Level, purpose: str) -> AbstractContextManager[None]: ...

        def _note_decline(self, s: Sequence | None, reason: str) -> None: ...

        def _rejoin(self) -> list[Event]: ...

    def _verify(
        self,
        b: BurstSeq,
        block: list[int] | None,
        proposal: mx.array | None,
        level: Level,
        ahead: Ahead | None,
        lookahead: bool,
    ) -> tuple[mx.array, mx.array | None, Ahead | None]:
        """The verify forward: one block, pinned to ``level`` (a lone token is a plain step), its graph
        taken from ``ahead`` when the last round built it. ``block`` ``None``: its drafts are
        ``proposal`` (``[1, K]``, not evaluated), computed with the verify in one evaluation. With
        ``lookahead`` the next round's verify is built while this one runs on the device
        (``workers.engine.spec.lookahead``). Returns the logits rows, for drafters that need them the hidden
        states, and the next round's verify if built."""
        solo = block is not None and len(block) == 1
        scope = self._classic(level, "verify") if solo else self.host.pinned(level, "verify")
        hidden, nxt = None, None
        with scope:
            if ahead is not None:
                logits, hidden = ahead.logits, ahead.hidden
            else:
                if block is not None:
                    inputs = mx.array([block])
                else:
                    assert proposal is not None
                    inputs = mx.concatenate([mx.array([[b.pending]], dtype=proposal.dtype), proposal], axis=1)
                if self.drafter is not None and self.drafter.needs_hidden:
                    logits, hidden = self.host.counted.with_hidden(inputs, b.cache)
                else:
                    logits = self.host.counted(inputs, cache=b.cache)
            outs = [a for a in (logits, hidden, proposal) if a is not None]
            if lookahead:
                mx.async_eval(*outs)
                assert self.drafter is not None
                drafts = block if block is not None else proposal
                nxt = build_next(self.host.counted, self.drafter, self.settings.k, b, drafts, level, logits, hidden)
            mx.eval(*outs)
        return logits[0], hidden, nxt

    def round(self) -> list[Event]:
        """One speculative round: draft, (maybe audit,) verify, accept, emit; then whether to go on."""
        b = self.current
        assert b is not None and self.drafter is not None
        level, why = self._verdict_level()
        if level is None:  # revoked or re-probed away while bursting
            self._note_decline(b.seq, why or "revoked")
            return self._rejoin()
        s = b.seq
        tic = time.perf_counter()
        audit = self._auditor.pick()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.block is None and (audit or ahead.level is not level):
            ahead.undo(b.cache)  # the drafter's proposal built ahead stays: it is this round's
            ahead = None
        block: list[int] | None = None  # for a round built on the drafter's outputs: known after its verify
        draft = Draft([])
        proposal = None
        lazy = getattr(self.drafter, "propose_lazy", None) if self.settings.draft_in_verify else None
        try:
            if ahead is not None and ahead.block is None:
                proposal = self.drafter.take_prepared()  # type: ignore[attr-defined]
                assert proposal is ahead.drafts
            elif ahead is None and lazy is not None and not audit and self.settings.k >= 1:
                # Queued now, so the device drafts while the host builds the verify on the drafts.
                proposal = lazy(self.settings.k)
                mx.async_eval(proposal)
                self.counters.fused += 1
            else:
                draft = self.drafter.propose(self.settings.k, b.sampler)
                block = [b.pending, *draft.tokens]
        except Exception:
            log.exception("drafter failed mid-burst; sequence %d decodes classic", s.job.seq)
            s.no_burst = "drafter_error"
            if ahead is not None:
                ahead.undo(b.cache)
            return self._rejoin()
        audit = audit and (block is None or len(block) > 1)
        if ahead is not None and block is not None and (audit or ahead.block != block or ahead.level is not level):
            ahead.undo(b.cache)  # a wrong guess
            ahead = None
        self.counters.ahead += ahead is not None
        single = None
        if audit:
            with self._classic(level, "audit"):
                single = self.host.counted(mx.array([[b.pending]]), cache=b.cache)[0, 0]
                mx.eval(single)
            trim_prompt_cache(b.cache, 1)
        can_build_ahead = (
            self.settings.lookahead
            and not audit
            and (block is None or len(block) > 1)
            and b.sampler is None
            and plain(b.cache)
            # A proposal built on this round's outputs takes the raw argmax for its bonus token.
            and not (b.controls.active and self.drafter.needs_hidden)
        )
        lookahead = can_build_ahead and self.adaptive.build_ahead()
        logits, hidden, nxt = self._verify(b, block, proposal, level, ahead, lookahead)
        if proposal is not None:  # the drafter's proposal built ahead, computed with this verify
            draft = Draft(token_list(proposal))
            block = [b.pending, *draft.tokens]
        assert block is not None
        self.counters.rounds += 1
        self.counters.drafted += len(draft.tokens)
        if single is not None:
            self.counters.audits += 1
            if not bytes_equal(single, logits[0]):
                return self._revoke(b, len(block), level)
        if b.controls.active:  # the rows classic decode would sample from (a draft the grammar refuses ends them)
            logits = b.controls.apply(b.history, block, logits)
        kept_rows = logits.shape[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if b.sampler is None:
            outcome = accept_greedy(draft.tokens[: kept_rows - 1], logits)
        else:  # a refused draft stays: its row gives it no mass, so it is rejected and drawn past from the residual
            outcome = accept_sampled(draft.tokens[:kept_rows], draft.q, logprobs, b.sampler)
        a = outcome.accepted
        b.controls.settle(a, outcome.next_token)
        self.counters.accepted += a
        if nxt is not None:  # kept only while the guess still holds: every draft and the bonus token
            if a == len(draft.tokens) and (nxt.block is None or outcome.next_token == nxt.block[0]):
                self._ahead = nxt
                if nxt.block is None:
                    self.drafter.confirm()  # type: ignore[attr-defined]
                # Launched now, so the device runs it while this round's tokens go out: the next round
                # almost always finds the same block (a drafter guessed from the history alone), and
                # if not, its tokens are trimmed and the result is dropped.
                nxt.launch()
            else:
                nxt.undo(b.cache)  # never launched: nothing of it is computed
                if nxt.block is None:
                    self.drafter.unprepare()  # type: ignore[attr-defined]
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
        events = self.host.emit(s, candidates, lps, tops)
        self.counters.emitted += sum(len(e.tokens) for e in events if isinstance(e, Tokens))
        if not self.host.admitted(s):
            return events
        try:
            self.drafter.commit(a, b.history, hidden)
        except Exception:
            log.exception("drafter failed mid-burst; sequence %d decodes classic", s.job.seq)
            s.no_burst = "drafter_error"
            return events + self._rejoin()
        elapsed = time.perf_counter() - tic
        self.counters.round_seconds += elapsed
        self._cycle = (tic, len(candidates), lookahead if can_build_ahead else None)
        events.append(StepInfo(StepKind.BURST_ROUND, elapsed, 1))
        # The policy reads the clock, so its "stop" is carried out at the next step's decision
        # (``Gate.stop``), which across ranks is rank 0's: the same step on every rank.
        self._stop_asked = not self.adaptive.after_round(time.perf_counter())
        return events

    def _revoke(self, b: BurstSeq, block_len: int, level: Level) -> list[Event]:
        """The audit caught the verify disagreeing with classic decode: fail closed for good."""
        assert self.pairing is not None
        self.counters.audit_failures += 1
        reason = (
            f"audit: verify at {level.value} differs from a single-token forward at position 0 "
            f"(request seq {b.seq.job.seq}, context {len(b.history) - 1} tokens)"
        )
        self.revoked[self.pairing] = reason
        log.warning("revoking the verdict for %s: %s", self.pairing, reason)
        trim_prompt_cache(b.cache, block_len)  # drop the whole unverified block
        return self._rejoin()
