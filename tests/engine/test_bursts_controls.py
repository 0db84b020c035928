"""Bursts of a lone request with logits controls (penalties, bias, ``min_tokens``) or a grammar, on the
shipped demo pair: the verify applies the same processors and grammar mask position by position, so
the request still bursts (drafts kept, nothing declined) and its tokens and logprobs are classic
decode's byte for byte, alone and when an arrival ends its burst.

Two drafters: the shipped MTP head (its next round is never built ahead under controls: that guess
takes the raw argmax) and prompt lookup (whose rounds built ahead are processed like any other).
The verdict is given as the CPU's (exact at ``wide``, as tests/engine/test_probe.py measures)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from tests.helpers import engine_runs
from workers.api import BurstSettings, Job, SamplingParams
from workers.api.grammar import grammar_text
from workers.engine.engine import Engine
from workers.engine.spec.drafters import Drafter, PromptLookup, load_drafter, load_mtp_drafter
from workers.exact.probe import Verdict

SETTINGS = BurstSettings(k=3, audit_fraction=0.0, profile_steps=0, min_rounds=10**9, lookahead_choice=False)
PROMPT = "def fibonacci(n):"
Run = tuple[list[int], list[float], list[Any], str]


@pytest.fixture(scope="module")
def demo() -> Any:
    from workers.models.loading import load as load_model

    return load_model("demo")


def drafter_for(demo: Any, kind: str) -> Drafter:
    if kind == "draft-model":  # the shipped draft model: sampled, its drafts come with their distributions
        return load_drafter("demo", demo.model, demo.info.vocab_size)
    return load_mtp_drafter("demo", demo.model) if kind == "mtp" else PromptLookup()


def engine_for(demo: Any, drafter: Drafter | None, settings: BurstSettings = SETTINGS) -> Engine:
    engine = Engine(demo.model, eos_token_ids=demo.info.eos_token_ids, vocab_size=demo.info.vocab_size)
    engine.tokenizer = demo.tokenizer
    if drafter is not None:
        engine.configure_bursts(drafter, settings, "demo+x")
        engine.verdicts["demo+x"] = Verdict("", {}, "wide", True, "CPU: exact", [], 0.0)
    return engine


def run(engine: Engine, jobs: list[Job], arrivals: dict[int, list[Job]] | None = None) -> dict[int, Run]:
    """Submit ``jobs``, then step (``arrivals[i]`` are submitted before step ``i``): per sequence its
    tokens, logprobs, top logprobs and finish reason."""
    return {
        seq: (o.tokens, o.lps or [], o.tops or [], o.end) for seq, o in engine_runs.run(engine, jobs, arrivals).items()
    }


def job(
    demo: Any, seq: int = 0, prompt: str = PROMPT, n: int = 32, stop_token_ids: tuple[int, ...] = (), **controls: Any
) -> Job:
    return Job(
        seq=seq,
        prompt=demo.tokenizer.encode(prompt),
        max_tokens=n,
        sampling=SamplingParams(**controls),
        stop_token_ids=stop_token_ids,
        logprobs=True,
        top_logprobs=3,
    )


def exact_bursts(demo: Any, j: Job, kind: str) -> Engine:
    """Run ``j`` alone with bursts and without; assert the bursts kept drafts, declined nothing, and
    emitted classic decode's tokens, logprobs and top logprobs. The bursting engine is returned."""
    want = run(engine_for(demo, None), [j])
    engine = engine_for(demo, drafter_for(demo, kind))
    assert run(engine, [j]) == want
    c = engine.bursts
    assert c.rounds > 0 and 0 < c.accepted <= c.drafted, c
    assert c.declined == {}, c.declined
    return engine


CONTROLS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "presence": lambda demo: {"presence_penalty": 1.5},
    "frequency": lambda demo: {"frequency_penalty": 1.0},
    "repetition": lambda demo: {"repetition_penalty": 1.3},
    "logit_bias": lambda demo: {"logit_bias": ((demo.tokenizer.encode(" return")[0], 5.0),)},
    # The demo model's greedy output of PROMPT has this token second: a stop there that ``min_tokens``
    # holds off until 24 tokens are out.
    "min_tokens": lambda demo: {"min_tokens": 24, "stop_token_ids": (221,)},
}


@pytest.mark.parametrize("kind", ["mtp", "prompt-lookup"])
@pytest.mark.parametrize("control", list(CONTROLS))
def test_a_lone_request_with_a_control_bursts_and_equals_classic_decode(demo: Any, control: str, kind: str) -> None:
    j = job(demo, **CONTROLS[control](demo))
    plain = run(engine_for(demo, None), [replace(j, sampling=SamplingParams())])[0][0]
    assert run(engine_for(demo, None), [j])[0][0] != plain, "the control must change the output to test anything"
    exact_bursts(demo, j, kind)


GRAMMARS = {
    "regex": (grammar_text("regex", r"[a-z ]{5,40}\."), None),
    "json_schema": (
        grammar_text(
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
                    "required": ["name", "n"],
                    "additionalProperties": False,
                }
            ),
        ),
        json.loads,
    ),
}


@pytest.mark.parametrize("kind", ["mtp", "prompt-lookup"])
@pytest.mark.parametrize("grammar", list(GRAMMARS))
def test_a_lone_request_with_a_grammar_bursts_and_equals_classic_decode(demo: Any, grammar: str, kind: str) -> None:
    """The matcher is advanced through each round's drafts and rolled back to the kept ones (some
    rounds reject drafts: the rollback is exercised)."""
    text, parse = GRAMMARS[grammar]
    j = job(demo, n=48, grammar=text)
    engine = exact_bursts(demo, j, kind)
    assert engine.bursts.accepted < engine.bursts.drafted or kind == "mtp"
    tokens, _, _, end = run(engine_for(demo, None), [j])[0]
    out = demo.tokenizer.decode(tokens)
    if end == "stop":
        assert parse(out) if parse else re.fullmatch(r"[a-z ]{5,40}\.", out), out


@pytest.mark.parametrize("controls", [{"presence_penalty": 1.5}, {"grammar": GRAMMARS["json_schema"][0]}])
def test_a_controlled_burst_ended_by_an_arrival_goes_on_exactly_in_the_batch(
    demo: Any, controls: dict[str, Any]
) -> None:
    """An arrival ends the burst: the sequence rejoins the batch, whose processors (and grammar
    matcher) take over where the verify left them; both requests equal classic decode alone."""
    first = job(demo, 0, n=40, **controls)
    second = job(demo, 1, prompt="class Stack:", n=24)
    want = {j.seq: run(engine_for(demo, None), [j])[j.seq] for j in (first, second)}
    engine = engine_for(demo, drafter_for(demo, "mtp"))
    got = run(engine, [first], arrivals={6: [second]})
    assert {s: g[0] for s, g in got.items()} == {s: w[0] for s, w in want.items()}
    assert got[0] == want[0]
    assert engine.bursts.interrupted == 1 and engine.bursts.accepted > 0


@pytest.mark.parametrize("kind", ["mtp", "draft-model"])
def test_a_sampled_grammar_request_bursts_within_its_grammar(demo: Any, kind: str) -> None:
    """Sampled bursts draw with the sequence's own sampler, not the grammar's wrapper (exact in
    distribution, not in draws; a draft the grammar refuses is rejected and drawn past from the
    residual): the output still satisfies the grammar."""
    j = job(demo, n=48, temperature=1.0, seed=5, grammar=GRAMMARS["regex"][0])
    engine = engine_for(demo, drafter_for(demo, kind))
    tokens, _, _, end = run(engine, [j])[0]
    assert engine.bursts.rounds > 0 and engine.bursts.accepted > 0 and engine.bursts.declined == {}
    out = demo.tokenizer.decode(tokens)
    assert re.fullmatch(r"[a-z ]{0,40}\.?", out), out
    if end == "stop":
        assert re.fullmatch(r"[a-z ]{5,40}\.", out), out
