"""The burst runner: speculative rounds for the lone sequence, and everything that governs them.

It holds the drafter, the adaptive gate, the auditor, the revocations and the burst in progress;
the engine asks it each step whether to burst (``wants``) and otherwise runs a batched step. The
sequence itself stays the engine's: the runner takes it out of the batch, emits its tokens and
puts it back through the ``BurstHost`` calls, so token accounting is the engine's in both modes.
A round itself (draft, verify, accept, emit) is ``rounds``.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache

from workers.api import BurstSettings, Event, Level
from workers.engine.sequences import BurstHost, Parked, Sequence
from workers.engine.spec.controls import Controls
from workers.engine.spec.drafters import Drafter
from workers.engine.spec.lookahead import Ahead
from workers.engine.spec.policy import Adaptive, Auditor, BurstCounters, BurstSeq, Gate
from workers.engine.spec.rounds import Rounds
from workers.exact import Verdicts, unpinned

log = logging.getLogger("mlx_batchd.engine")


class BurstRunner(Rounds):
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
        controls = Controls(s.processors)
        self.current = BurstSeq(
            s,
            p.cache,
            p.history,
            p.pending,
            p.pending_logprob,
            controls.sampler(s.sampler),
            s.stops,
            pending_top=p.pending_top,
            controls=controls,
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

    # ------------------------------------------------------------------ a guess built ahead

    def _drop_ahead(self) -> None:
        """Put the burst's caches back as the last round left them, if a guess was built on them."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and self.current is not None:
            ahead.undo(self.current.cache)

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
