"""The burst runner: speculative rounds for the lone sequence, and everything that governs them.

It holds the drafter, the adaptive gate, the auditor, the revocations and the burst in progress;
the engine asks it each step whether to burst (``wants``) and otherwise runs a batched step. The
sequence itself stays the engine's: the runner takes it out of the batch, emits its tokens and
puts it back through the ``BurstHost`` calls, so token accounting is the engine's in both modes.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from workers.api import BurstSettings, Event, Level, StepInfo, StepKind, Tokens, TopLogprobs
from workers.engine.sequences import BurstHost, Parked, Sequence, top_logprobs
from workers.engine.spec.accept import accept_greedy, accept_sampled
from workers.engine.spec.drafters import Draft, Drafter, token_list
from workers.engine.spec.lookahead import Ahead, build_next, plain
from workers.engine.spec.policy import Adaptive, Auditor, BurstCounters, BurstSeq, Gate
from workers.exact import Verdicts, unpinned
from workers.kernels import as_float, bytes_equal

log = logging.getLogger("mlx_batchd.engine")


class BurstRunner:
    """B = 1 bursts: granted by the verdict and the adaptive gate, audited, revoked on a mismatch."""

    def __init__(self, host: BurstHost, verdicts: Verdicts) -> None:
        self.host = host
        self.verdicts = verdicts
        self.drafter: Drafter | None = None
        self.settings = BurstSettings()
        self.pairing: str | None = None
        self.revoked: dict[str, str] = {}
        self.counters = BurstCounters()
        self.adaptive = Adaptive(self.settings)
        self._auditor = Auditor(0.0, 0)
        #: The burst in progress, if any.
        self.current: BurstSeq | None = None
        #: Events of a burst that ended before it began (the drafter failed to start): its pending
        #: token, emitted with the next step's events.
        self._held: list[Event] = []
        self._last_decline: tuple[int, str] | None = None
        #: The last round found bursting does not pay: the burst ends at the next step's decision.
        self._stop_asked = False
        #: The next round's verify, guessed and built on the burst's caches (``workers.engine.spec.lookahead``).
        self._ahead: Ahead | None = None
        #: The last step, timed to the next step's start (``cycle_ended``): its start, the tokens of
        #: a round (0: a classic step of the lone sequence) and whether the round built ahead.
        self._cycle: tuple[float, int, bool | None] | None = None

    def configure(self, drafter: Drafter, settings: BurstSettings, pairing: str) -> None:
        """Enable B = 1 bursts with ``drafter``; they run once ``pairing`` has a usable verdict."""
        self.drafter = drafter
        self.settings = settings
        self.pairing = pairing
        self.adaptive = Adaptive(settings)
        self._auditor = Auditor(settings.audit_fraction, settings.seed)

    def holds(self, s: Sequence) -> bool:
        """Whether ``s`` is the sequence bursting now."""
        return self.current is not None and self.current.seq is s

    # ------------------------------------------------------------------ the decision

    def gate(self, now: float) -> Gate:
        """The clock-driven inputs of the next ``wants``, as of ``now`` (``time.perf_counter``)."""
        return Gate(self.adaptive.refusal(now), self._stop_asked)

    def wants(self, live: list[Sequence], gate: Gate | None = None) -> bool:
        """Whether this step is a burst round: the burst goes on while its sequence is alone, and a
        new one starts when the lone decoding sequence may burst (a refusal is counted).

        ``gate`` is the clock-driven part, taken now from this process's clock when not given; a
        burst whose last round asked to stop ends here (its sequence rejoins the batch, its pending
        token is emitted with this step's events)."""
        gate = self.gate(time.perf_counter()) if gate is None else gate
        if self.current is not None:
            if not gate.stop:
                return len(live) == 1
            self._note_decline(self.current.seq, "adaptive")
            self._held += self._rejoin()
            return False
        if self.drafter is None:
            return False
        s, why = self._refusal(live, gate)
        if why is not None:
            if why not in ("no_drafter",):
                self._note_decline(s, why)
            return False
        return s is not None and self._start(s)

    def interrupt(self, live: list[Sequence]) -> list[Event]:
        """End a burst that is no longer alone (its sequence rejoins the batch); nothing otherwise."""
        held, self._held = self._held, []
        if self.current is None:
            return held
        self.counters.interrupted += 1
        self._note_decline(self.current.seq, "contention")
        return held + self._rejoin()

    def classic_began(self, tic: float) -> None:
        """A classic decode step of the lone sequence began at ``tic`` (``time.perf_counter``)."""
        self._cycle = (tic, 0, None)

    def cycle_ended(self, now: float | None) -> None:
        """Hand the adaptive gate the last step's wall time, from its start to ``now`` (the next step's
        start): a classic step or a round, each with everything the engine's loop does for it
        (emitting its tokens, handing them to the front end). ``None``: the loop had no work after
        the step and waited, which is no part of it.

        Why to the next start: timed inside the step, a classic step left out the loop's work for its
        one token, which a round pays once for its four or five. With a small model that work is a
        large share of a classic token's cost, and leaving it out paused bursts that paid."""
        cycle, self._cycle = self._cycle, None
        if cycle is None or now is None:
            return
        tic, tokens, ahead = cycle
        if tokens:
            self.adaptive.observe_round(now - tic, tokens, ahead)
        else:
            self.adaptive.observe_classic(now - tic)

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

    def chain_level(self) -> Level | None:
        """The level the lone sequence's classic steps must run at for bursts to stay exact: the
        verdict's rung when it pins the chain (``padded``), else ``None`` (classic decode as is)."""
        level, _ = self._verdict_level()
        return level if level is not None and level.pins_chain else None

    def _classic(self, level: Level, purpose: str) -> AbstractContextManager[None]:
        """A forward that stands for classic decode inside a burst (the audit's single token, a
        one-token verify): unpinned, or at the verdict's rung when that rung pins the chain."""
        return self.host.pinned(level, purpose) if level.pins_chain else unpinned(purpose)

    def _refusal(self, live: list[Sequence], gate: Gate) -> tuple[Sequence | None, str | None]:
        if len(live) != 1:  # paused sequences do not contend
            return None, "contention" if len(live) > 1 else None
        (s,) = live
        if not self.host.decoding(s):
            return None, None  # still prefilling: nothing to decide yet
        if s.no_burst:
            return s, s.no_burst
        _, why = self._verdict_level()
        if why is not None:
            return s, why
        return s, gate.refusal

    def _note_decline(self, s: Sequence | None, reason: str) -> None:
        """Count a declined burst once per (sequence, reason) episode, not once per step."""
        key = (-1 if s is None else s.job.seq, reason)
        if key != self._last_decline:
            self._last_decline = key
            self.counters.declined[reason] = self.counters.declined.get(reason, 0) + 1

    # ------------------------------------------------------------------ starting and ending

    def _start(self, s: Sequence) -> bool:
        cache = self.host.cache_of(s)
        if not can_trim_prompt_cache(cache):
            s.no_burst = "not_trimmable"
            self._note_decline(s, s.no_burst)
            return False
        p = self.host.take_out(s)
        self.current = BurstSeq(
            s, p.cache, p.history, p.pending, p.pending_logprob, s.sampler, s.stops, pending_top=p.pending_top
        )
        assert self.drafter is not None
        try:
            self.drafter.start(p.history)
        except Exception:
            log.exception("drafter failed to start; sequence %d decodes classic", s.job.seq)
            s.no_burst = "drafter_error"
            self._note_decline(s, s.no_burst)
            self._held += self._rejoin()
            return False
        self.counters.bursts += 1
        return True

    def end(self) -> None:
        """Drop the burst in progress (its sequence is the caller's to finish or park)."""
        self._drop_ahead()
        if self.current is not None and self.drafter is not None:
            self.drafter.stop()
        self.current = None
        self._stop_asked = False

    def close(self, keep: bool) -> None:
        """End the burst of a sequence that ends, offering its KV to the prefix cache when ``keep``."""
        self._drop_ahead()  # the caches as the last round left them, before they are kept
        if keep:
            self._keep(self.current)
        self.end()

    def park(self) -> Parked:
        """End the burst and hand back its sequence's state, to sit out of the batch."""
        b = self.current
        assert b is not None
        self.end()
        return Parked(b.cache, b.history, b.pending, b.pending_logprob, b.pending_top)

    def _keep(self, b: BurstSeq | None) -> None:
        """A burst's cache, kept only under an exact, unrevoked verdict (its KV came from verify forwards)."""
        verdict = None if self.pairing is None else self.verdicts.get(self.pairing)
        if b is not None and verdict is not None and verdict.exact and self.pairing not in self.revoked:
            self.host.keep_prefix(b.seq, b.cache, b.history[:-1])

    def _rejoin(self) -> list[Event]:
        """End the burst: emit the pending token and put the sequence back into the batch with its cache."""
        b = self.current
        assert b is not None
        return self.host.put_back(b.seq, self.park())

    # ------------------------------------------------------------------ the round

    def _drop_ahead(self) -> None:
        """Put the burst's caches back as the last round left them, if a guess was built on them."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and self.current is not None:
            ahead.undo(self.current.cache)

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
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if b.sampler is None:
            outcome = accept_greedy(draft.tokens, logits)
        else:
            outcome = accept_sampled(draft.tokens, draft.q, logprobs, b.sampler)
        a = outcome.accepted
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

    def summary(self) -> dict[str, Any]:
        return {
            "drafter": None if self.drafter is None else self.drafter.name,
            "k": self.settings.k,
            "active": self.current is not None,
            "bursts": self.counters.bursts,
            "rounds": self.counters.rounds,
            "drafted_tokens": self.counters.drafted,
            "accepted_tokens": self.counters.accepted,
            "emitted_tokens": self.counters.emitted,
            "interrupted": self.counters.interrupted,
            "declined": dict(self.counters.declined),
            "audits": self.counters.audits,
            "audit_failures": self.counters.audit_failures,
            "ahead_rounds": self.counters.ahead,
            "fused_rounds": self.counters.fused,
            "round_seconds": self.counters.round_seconds,
            "revoked": dict(self.revoked),
            "speedup_estimate": self.adaptive.speedup,
            "classic_step_s": self.adaptive.classic_step_s,
            "round_s": self.adaptive.round_s,
            "last_pause": self.adaptive.last_pause,
            "ahead_round_s": self.adaptive.ahead_medians(),
        }
