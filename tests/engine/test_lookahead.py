"""The next burst round's verify built while this round runs (``workers.engine.spec.lookahead``), on the CPU.

The drafter here is a stand-in (named as such): it knows the target's greedy continuation, computed
beforehand by classic decode, so its drafts are kept and its guesses of the next round are right,
except where a test makes them wrong. Exactness is checked token for token against classic decode.
"""

from __future__ import annotations

import struct
from dataclasses import replace
from typing import Any

import pytest

from tests.engine.test_bursts import EXACT_FOREVER, job, make_engine
from tests.engine.test_bursts import clean_kernel_state as clean_kernel_state
from tests.engine.test_bursts import demo as demo
from tests.engine.test_bursts import paths as paths
from tests.engine.test_bursts import target as target
from workers.api import MTP_K, Job, Tokens
from workers.engine.engine import Engine
from workers.engine.sampling import SeededSampler
from workers.engine.spec.drafters import Draft

PROMPT = [5, 6, 7]
TOKENS = 40


class Oracle:
    """Stand-in drafter that proposes the target's own greedy continuation (``path``: the tokens
    classic decode emits), by position. ``wrong_at``: positions where it proposes a wrong token, so
    a round keeps only the drafts before it (a guess made on all of them fails when the round ends).
    ``wrong_guesses``: every other guess of a next round's drafts starts with a wrong token, while its
    real proposals stay right (the guess fails when the next round starts)."""

    needs_hidden = False

    def __init__(self, path: list[int], wrong_at: frozenset[int] = frozenset(), wrong_guesses: bool = False) -> None:
        self.name = "oracle"
        self.path = path
        self.wrong_at = wrong_at
        self.wrong_guesses = wrong_guesses
        self.guesses = 0
        self._history: list[int] = []

    def _follow(self, n: int, k: int) -> list[int]:
        return [(t + 1) % 250 if i in self.wrong_at else t for i, t in enumerate(self.path) if n <= i < n + k]

    def start(self, history: list[int]) -> None:
        self._history = list(history)

    def propose(self, k: int, sampler: SeededSampler | None) -> Draft:
        return Draft(self._follow(len(self._history), k))

    def propose_after(self, history: list[int], k: int) -> list[int]:
        out = self._follow(len(history), k)
        if self.wrong_guesses and k > 1 and out:  # ``guess`` asks for more than one token only for drafts
            self.guesses += 1
            if self.guesses % 2:
                out = [(out[0] + 1) % 250, *out[1:]]
        return out

    def commit(self, accepted: int, history: list[int], hidden: Any = None) -> None:
        self._history = list(history)

    def stop(self) -> None:
        self._history = []


def _emitted(engine: Any, jobs: list[Job], arrivals: dict[int, list[Job]] | None = None) -> dict[int, Any]:
    """Each sequence's tokens and the bytes of their logprobs (more sensitive to a cache holding
    keys it should not than the tokens of a small random model are), stepping until idle."""
    got: dict[int, tuple[list[int], list[float]]] = {}
    arrivals = dict(arrivals or {})
    for j in jobs:
        engine.submit(j)
    step = 0
    while engine.has_work or arrivals:
        for j in arrivals.pop(step, []):
            engine.submit(j)
        for e in engine.step():
            if isinstance(e, Tokens):
                toks, lps = got.setdefault(e.seq, ([], []))
                toks += e.tokens
                lps += e.logprobs or []
        step += 1
    return {seq: (toks, struct.pack(f"{len(lps)}d", *lps)) for seq, (toks, lps) in got.items()}


def _classic(target: Any, j: Job) -> Any:
    return _emitted(make_engine(target, None), [j])[j.seq]


def _watched(engine: Engine) -> list[bool]:
    """Whether a round built ahead sat on the burst's caches each time a burst was interrupted."""
    seen: list[bool] = []
    real = engine.runner.interrupt

    def interrupt(live: Any) -> Any:
        if engine.runner.current is not None:
            seen.append(engine.runner._ahead is not None)
        return real(live)

    engine.runner.interrupt = interrupt  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("kind", ["right", "wrong-drafts", "wrong-guesses"])
def test_rounds_built_ahead_emit_classic_decodes_tokens(target: Any, kind: str) -> None:
    """Every guess right, rounds that keep only some drafts, or guesses that the next round's real
    proposal contradicts: tokens and logprobs are classic decode's; right guesses are used (their
    rounds counted), wrong ones never."""
    want = _classic(target, job(0, PROMPT, TOKENS, logprobs=True))
    path = PROMPT + want[0]
    wrong_at = frozenset(range(len(PROMPT) + 5, len(path), 7)) if kind == "wrong-drafts" else frozenset()
    engine = make_engine(target, Oracle(path, wrong_at, kind == "wrong-guesses"), EXACT_FOREVER)
    assert _emitted(engine, [job(0, PROMPT, TOKENS, logprobs=True)])[0] == want
    c = engine.runner.counters
    assert c.rounds > 3
    if kind == "right":
        assert c.ahead == c.rounds - 1  # each round after the first was built during the one before
    else:
        assert 0 < c.ahead < c.rounds - 1
    assert engine.runner.summary()["ahead_rounds"] == c.ahead


def test_a_burst_ended_with_a_round_built_ahead_leaves_the_cache_as_its_last_round(target: Any) -> None:
    """Another request arrives while a guessed round sits on the burst's caches: the sequence goes
    back to the batch with the caches its last round left, and both requests get classic decode's
    tokens and logprobs."""
    first, other = job(0, PROMPT, TOKENS, logprobs=True), job(1, [40, 41, 42], 12, logprobs=True)
    want = _classic(target, first)
    engine = make_engine(target, Oracle(PROMPT + want[0]), EXACT_FOREVER)
    ahead_at_arrival = _watched(engine)
    got = _emitted(engine, [first], arrivals={4: [other]})
    assert ahead_at_arrival == [True]
    assert got[0] == want
    assert got[1] == _classic(target, other)


def test_a_burst_that_ends_with_a_round_built_ahead_keeps_its_last_rounds_kv(target: Any) -> None:
    """A sequence that ends mid-burst offers its KV to the prefix cache: the KV of exactly the
    tokens it was given, not those of a guessed round still on its caches."""
    from workers.engine.prefix_cache import PrefixCache
    from workers.engine.prefix_check import ReuseVerdict

    first = job(0, PROMPT, TOKENS, cache_salt="t")
    longer = _classic(target, job(0, PROMPT, TOKENS + 12))[0]  # the drafter sees past the end
    engine = make_engine(target, Oracle(PROMPT + longer), EXACT_FOREVER)
    engine.prefix_cache = PrefixCache(1 << 30, ReuseVerdict(True, "stand-in verdict: this CPU is exact"))
    ahead_at_end: list[bool] = []
    real_close = engine.runner.close

    def close(keep: bool) -> None:
        ahead_at_end.append(engine.runner._ahead is not None)
        real_close(keep)

    engine.runner.close = close  # type: ignore[method-assign]
    assert _emitted(engine, [first])[0][0] == longer[:TOKENS]
    assert ahead_at_end == [True]
    lru = engine.prefix_cache._lru
    entries = [(salt, tokens) for q in lru._lru._lrus.values() for salt, tokens in q]
    assert entries
    for salt, tokens in entries:
        assert all(c.offset == len(tokens) for c in lru._trie.get(salt, tokens).prompt_cache)


# --------------------------------------------------------------------------- the MTP head


def _demo_engine(
    demo: Any, lookahead: bool | None, choice: bool = False, fused: bool = True, k: int = EXACT_FOREVER.k
) -> Engine:
    """The shipped pair's target; with ``lookahead`` not ``None``, the shipped MTP head drafting
    ``k`` tokens a round, its verdict given as the CPU's (exact at ``wide``, as
    tests/engine/test_probe.py measures); ``choice``: ``BurstSettings.lookahead_choice``; ``fused``:
    ``BurstSettings.draft_in_verify``."""
    from workers.engine.spec.drafters import load_mtp_drafter
    from workers.exact.probe import Verdict

    engine = Engine(demo.model, eos_token_ids=demo.info.eos_token_ids, vocab_size=demo.info.vocab_size)
    if lookahead is not None:
        settings = replace(EXACT_FOREVER, lookahead=lookahead, lookahead_choice=choice, draft_in_verify=fused, k=k)
        engine.configure_bursts(load_mtp_drafter("demo", demo.model), settings, "demo+mtp")
        engine.verdicts["demo+mtp"] = Verdict("", {}, "wide", True, "CPU: exact", [], 0.0)
    return engine


@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "x = [", "for i in range(10):"])
def test_mtp_rounds_built_on_the_verifys_outputs_emit_classic_decodes_tokens(demo: Any, prompt: str) -> None:
    """The MTP head's next proposal and the next verify are built on this round's hidden states and
    bonus token before they are computed, and kept when the round keeps every draft: tokens and
    logprob bytes equal classic decode's, the rounds and kept drafts those of bursts without building
    ahead, and rounds were built ahead (on the last two prompts not all: the head's drafts are not
    always all kept there, so some rounds' proposals built ahead are put back)."""
    j = job(0, demo.tokenizer.encode(prompt), 48, logprobs=True)
    want = _emitted(_demo_engine(demo, None), [j])[0]
    plain_bursts = _demo_engine(demo, lookahead=False)
    assert _emitted(plain_bursts, [j])[0] == want
    engine = _demo_engine(demo, lookahead=True)
    assert _emitted(engine, [j])[0] == want
    c, p = engine.runner.counters, plain_bursts.runner.counters
    assert (c.rounds, c.accepted) == (p.rounds, p.accepted) and p.ahead == 0
    if prompt == "def fibonacci(n):":
        assert c.accepted == c.drafted and c.ahead == c.rounds - 1
    else:
        assert c.accepted < c.drafted and 0 < c.ahead < c.rounds - 1


@pytest.mark.parametrize("k", [EXACT_FOREVER.k, MTP_K])
@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "x = ["])
def test_mtp_drafts_computed_with_the_verify_emit_classic_decodes_tokens(demo: Any, prompt: str, k: int) -> None:
    """``draft_in_verify``: the head's drafts are built into the verify's graph and computed with it
    in one evaluation. Tokens and logprob bytes equal classic decode's and those of rounds whose
    drafts were evaluated first, with the same rounds and kept drafts; every round not built ahead
    was fused (with building ahead too: the first round, and those after a round that did not keep
    every draft), none with it off. At 3 drafts a round and at the 7 ``serve --mtp`` drafts unless told."""
    j = job(0, demo.tokenizer.encode(prompt), 48, logprobs=True)
    want = _emitted(_demo_engine(demo, None), [j])[0]
    first = _demo_engine(demo, lookahead=False, fused=False, k=k)
    assert _emitted(first, [j])[0] == want
    fused = _demo_engine(demo, lookahead=False, k=k)
    assert _emitted(fused, [j])[0] == want
    both = _demo_engine(demo, lookahead=True, k=k)
    assert _emitted(both, [j])[0] == want
    f, c, a = first.runner.counters, fused.runner.counters, both.runner.counters
    assert (c.rounds, c.accepted) == (f.rounds, f.accepted) == (a.rounds, a.accepted) and c.rounds > 3
    assert (f.fused, c.fused, a.fused) == (0, c.rounds, a.rounds - a.ahead) and a.ahead > 0
    assert fused.runner.summary()["fused_rounds"] == c.rounds


def test_an_mtp_burst_interrupted_with_a_round_built_ahead_stays_exact(demo: Any) -> None:
    first = job(0, demo.tokenizer.encode("def fibonacci(n):"), 48, logprobs=True)
    other = job(1, demo.tokenizer.encode("class Stack:"), 12, logprobs=True)
    want = {0: _emitted(_demo_engine(demo, None), [first])[0], 1: _emitted(_demo_engine(demo, None), [other])[1]}
    for arrival in range(3, 16):  # until an arrival finds a round built ahead on the caches
        engine = _demo_engine(demo, lookahead=True)
        seen = _watched(engine)
        assert _emitted(engine, [first], arrivals={arrival: [other]}) == want
        if seen == [True]:
            return
    raise AssertionError("no arrival found a round built ahead on the caches")


def test_mtp_rounds_that_choose_whether_to_build_ahead_emit_classic_decodes_tokens(demo: Any) -> None:
    """``lookahead_choice`` (the daemon's default, ``--lookahead auto``): an exploration (rounds
    built ahead, then blocks of rounds built ahead and not, interleaved), then the way timed faster;
    every round's tokens and logprob bytes are classic decode's whichever way it went, and both ways
    were timed."""
    from workers.engine.spec.policy import EXPLORE_ROUNDS

    j = job(0, demo.tokenizer.encode("def fibonacci(n):"), 5 * (EXPLORE_ROUNDS + 8), logprobs=True)
    want = _emitted(_demo_engine(demo, None), [j])[0]
    engine = _demo_engine(demo, lookahead=True, choice=True)
    assert _emitted(engine, [j])[0] == want
    c, medians = engine.runner.counters, engine.runner.summary()["ahead_round_s"]
    assert c.rounds > EXPLORE_ROUNDS and medians["on"] is not None and medians["off"] is not None
    assert 0 < c.ahead < c.rounds - 1  # rounds built ahead, and rounds not
