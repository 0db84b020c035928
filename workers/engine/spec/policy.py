"""Speculative bursts for the one active sequence (B = 1), and the policy that grants them.

A burst takes the sequence out of ``BatchGenerator`` with its KV cache and its pending token
(sampled by the last batched step, not yet emitted or fed), and runs rounds: the drafter proposes
up to K tokens, the target verifies ``[pending, drafts...]`` in one forward under the verdict's
level (scoped to that forward), the kept tokens are emitted and the rejected ones rolled back in
both caches. When another sequence arrives, the burst ends at the round boundary: the pending
token is emitted and the sequence goes back into ``BatchGenerator`` with its cache.

Token accounting mirrors ``GenerationBatch.next`` exactly: each emitted token counts toward
``max_tokens``; a stop token ends the sequence and is not emitted; stop wins over length.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from workers.api import BurstSettings, FinishReason
from workers.engine.sampling import SeededSampler
from workers.engine.sequences import Sequence
from workers.engine.spec.controls import Controls


@dataclass
class BurstCounters:
    bursts: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    interrupted: int = 0
    audits: int = 0
    audit_failures: int = 0
    #: Rounds whose verify was built while the previous round ran (``workers.engine.spec.lookahead``).
    ahead: int = 0
    #: Rounds whose drafts were built into the verify's graph (``BurstSettings.draft_in_verify``).
    fused: int = 0
    #: Wall seconds of every round, from drafting to emitting (the adaptive gate keeps only its
    #: latest rounds, and forgets them when it pauses bursts: this total says what rounds cost over any span).
    round_seconds: float = 0.0
    declined: dict[str, int] = field(default_factory=dict)


#: Rounds an exploration starts with, built ahead and timed for neither way: both ways' graphs are
#: built in them for the first time (a first use compiles kernels).
WARM_ROUNDS = 4
#: Rounds of one way in a row while exploring; a block's first round is not timed (it follows a round
#: of the other way: after a round built ahead, the next finds its verify already built).
BLOCK_ROUNDS = 4
#: The ways of the exploration's blocks, built ahead (``True``) or not: the Thue-Morse order, so that a
#: host that drifts during exploration slows both ways alike (ABBA BAAB: equal mean positions).
EXPLORE_BLOCKS = (True, False, False, True, False, True, True, False)
#: Rounds one exploration takes (``Adaptive.build_ahead``): 12 timed each way.
EXPLORE_ROUNDS = WARM_ROUNDS + BLOCK_ROUNDS * len(EXPLORE_BLOCKS)
#: Rounds after which both ways are timed afresh.
REEXPLORE_ROUNDS = 512


def _median(xs: deque[float]) -> float | None:
    return statistics.median(xs) if xs else None


@dataclass
class Adaptive:
    """Measured speedup of bursts over classic B = 1 decode, and the decision it drives.

    The estimate reads the latest ``window_rounds`` rounds and classic steps: the median seconds of
    each (a round whose kernels compiled for a new shape, or a step that waited on the host, is one
    sample among many and not the level every later sample decays from) and the mean tokens a round
    emitted (bounded by K + 1, and what throughput follows). A moving average seeded by its first
    sample let one round that waited on first-use compilation (the demo MTP head's projection is
    checked at its first use, during the first bursts) outweigh dozens of later rounds."""

    settings: BurstSettings
    rounds: int = 0
    #: Rounds that could build ahead since both ways were last timed afresh (``build_ahead``).
    rounds_since_explore: int = 0
    paused_until: float = 0.0
    #: Pauses in a row, without a window that paid since (``after_round``: each doubles the next).
    pauses: int = 0
    #: What the estimate read when it last paused bursting (``after_round``), kept after it forgets
    #: its samples: speedup, classic step and round seconds (medians), tokens a round (mean), rounds.
    last_pause: dict[str, float] | None = None
    _classic: deque[float] = field(default_factory=deque, repr=False)
    _round_s: deque[float] = field(default_factory=deque, repr=False)
    _tokens: deque[int] = field(default_factory=deque, repr=False)
    #: Round seconds by whether the round built the next one ahead (``build_ahead``).
    _ways: dict[bool, deque[float]] = field(default_factory=dict, repr=False)
    #: Whether the latest round was an exploration's (``exploring``).
    _explored_last: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        n = max(self.settings.window_rounds, self.settings.min_rounds, self.settings.profile_steps, 1)
        self._classic, self._round_s, self._tokens = deque(maxlen=n), deque(maxlen=n), deque(maxlen=n)
        self._ways = {True: deque(maxlen=EXPLORE_ROUNDS), False: deque(maxlen=EXPLORE_ROUNDS)}

    def build_ahead(self) -> bool:
        """Whether a round that can build the next round's verify ahead does: an exploration first
        (``WARM_ROUNDS`` built ahead and not timed, then ``EXPLORE_BLOCKS`` of ``BLOCK_ROUNDS``, each
        block's first round not timed), then the way whose median round was shorter; both are timed
        afresh every ``REEXPLORE_ROUNDS`` rounds and after a pause.

        Why interleaved, after a warm-up: timed one way after the other from a daemon's first bursts,
        the way timed first took its first uses and the host's moment, and read slower through the
        daemon than the same way forced in-process on the same machine.

        Why measured and not fixed: on a GPU building ahead paid on one lease and cost on the next: a
        round of a small model is host work, and which way is faster follows the host. Both ways give
        the same bytes (``workers.engine.spec.lookahead``)."""
        if not self.settings.lookahead:
            return False
        if not self.settings.lookahead_choice:
            return True
        i = self.rounds_since_explore
        if i < WARM_ROUNDS:
            return True
        if i < EXPLORE_ROUNDS:
            return EXPLORE_BLOCKS[(i - WARM_ROUNDS) // BLOCK_ROUNDS]
        on, off = self._ways[True], self._ways[False]
        return statistics.median(on) <= statistics.median(off)

    @property
    def exploring(self) -> bool:
        """Whether the latest round was one of an exploration (``build_ahead``) not yet finished."""
        return self._explored_last and self.settings.lookahead_choice and self.rounds_since_explore < EXPLORE_ROUNDS

    def ahead_medians(self) -> dict[str, float | None]:
        """Median round seconds built ahead (``on``) and not (``off``), as last timed."""
        return {"on": _median(self._ways[True]), "off": _median(self._ways[False])}

    @property
    def classic_samples(self) -> int:
        return len(self._classic)

    @property
    def classic_step_s(self) -> float | None:
        """Median seconds of the latest classic B = 1 steps."""
        return _median(self._classic)

    @property
    def round_s(self) -> float | None:
        """Median seconds of the latest rounds; where rounds were timed built ahead and not
        (``build_ahead``), the faster way's: the way bursting goes on with once both are timed, so
        that the rounds spent timing the slower way do not pause bursting that pays."""
        timed = [statistics.median(w) for w in self._ways.values() if w]
        return min(timed) if timed else _median(self._round_s)

    @property
    def tokens_per_round(self) -> float | None:
        return statistics.fmean(self._tokens) if self._tokens else None

    def observe_classic(self, seconds: float) -> None:
        self._classic.append(seconds)

    def observe_round(self, seconds: float, tokens: int, ahead: bool | None = None) -> None:
        """A round's wall seconds and emitted tokens; ``ahead``: whether it built the next round
        ahead (``build_ahead``'s answer), ``None`` for a round that could not."""
        self._round_s.append(seconds)
        self._tokens.append(tokens)
        self.rounds += 1
        self._explored_last = False
        if ahead is not None:
            i = self.rounds_since_explore
            self._explored_last = i < EXPLORE_ROUNDS
            if i >= EXPLORE_ROUNDS or (i >= WARM_ROUNDS and (i - WARM_ROUNDS) % BLOCK_ROUNDS):
                self._ways[ahead].append(seconds)
            self.rounds_since_explore += 1
            if self.rounds_since_explore >= REEXPLORE_ROUNDS:
                self._forget_ways()

    def _forget_ways(self) -> None:
        self._ways[True].clear()
        self._ways[False].clear()
        self.rounds_since_explore = 0

    @property
    def speedup(self) -> float | None:
        classic, round_s, tokens = self.classic_step_s, self.round_s, self.tokens_per_round
        if classic is None or round_s is None or tokens is None or round_s <= 0:
            return None
        return tokens * classic / round_s

    def refusal(self, now: float) -> str | None:
        """Why a burst may not start now, or ``None``."""
        if now < self.paused_until:
            return "adaptive"
        if self.classic_samples < self.settings.profile_steps:
            return "profiling"
        return None

    def after_round(self, now: float) -> bool:
        """Whether to keep bursting; pauses (and forgets the measurements) when it does not pay. Not
        during an exploration (``exploring``, at most ``EXPLORE_ROUNDS`` rounds): its estimate is
        the faster way's once both are timed, and a way half timed is not yet a verdict on either."""
        s = self.speedup
        if self.exploring:
            return True
        if self.rounds < self.settings.min_rounds or s is None:
            return True
        if s >= 1.0:
            self.pauses = 0
            return True
        first, longest = self.settings.reprofile_first_s, self.settings.reprofile_after_s
        self.paused_until = now + min(longest, first * 2.0**self.pauses)
        self.pauses += 1
        self.last_pause = {
            "speedup": s,
            "classic_step_s": self.classic_step_s or 0.0,
            "round_s": self.round_s or 0.0,
            "tokens_per_round": self.tokens_per_round or 0.0,
            "rounds": float(self.rounds),
        }
        self._classic.clear()
        self._round_s.clear()
        self._tokens.clear()
        self._forget_ways()
        self.rounds = 0
        return False


@dataclass(frozen=True)
class Gate:
    """The clock-driven part of a step's burst decision, taken apart so one process can make it for
    several: across ranks (``workers.engine.loop``) rank 0 takes it and every rank applies the same one,
    while the rest of the decision (who is alone, the verdict) follows from state every rank shares.

    ``refusal`` is the adaptive policy's answer now (``Adaptive.refusal``): why a burst may not
    start, or ``None``. ``stop`` ends the burst in progress because its last round found bursting
    does not pay (``Adaptive.after_round``)."""

    refusal: str | None = None
    stop: bool = False


@dataclass
class BurstSeq:
    """The sequence while it is out of the batch."""

    seq: Sequence
    cache: list[Any]
    history: list[int]  # prompt + emitted + pending
    pending: int
    pending_logprob: float | None
    sampler: SeededSampler | None
    stops: frozenset[int]
    #: The pending token's top logprobs, when the job asked for them (``engine.top_logprobs``).
    pending_top: list[tuple[int, float]] | None = None
    #: Its logits processors and grammar, applied to each verify row (``workers.engine.spec.controls``).
    controls: Controls = field(default_factory=lambda: Controls([]))


def emit_in_order(
    candidates: list[int], logprobs: list[float], emitted: int, max_tokens: int, stops: frozenset[int]
) -> tuple[list[int], list[float], FinishReason | None]:
    """What classic decode would emit from these tokens, in order: stops end (unemitted), the
    ``max_tokens``-th token ends with ``length``."""
    out: list[int] = []
    lps: list[float] = []
    for token, lp in zip(candidates, logprobs):
        emitted += 1
        if token in stops:
            return out, lps, FinishReason.STOP
        out.append(token)
        lps.append(lp)
        if emitted >= max_tokens:
            return out, lps, FinishReason.LENGTH
    return out, lps, None


class Auditor:
    """Chooses which rounds to audit, reproducibly."""

    def __init__(self, fraction: float, seed: int) -> None:
        self.fraction = fraction
        self._rng = random.Random(seed)

    def pick(self) -> bool:
        return self.fraction > 0 and self._rng.random() < self.fraction
