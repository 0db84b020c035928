"""Pausing and resuming a sequence on the engine (the front end's back-pressure), on a real tiny model.

A paused sequence must produce no tokens and cost no decode work, keep its KV cache and pending
token, and, once resumed, produce exactly the tokens it would have produced without the pause.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load

from tests.helpers.engine_thread import EngineThreadRun as Thread
from tests.reference import probed_bursts
from workers import kernels
from workers.api import BurstSettings, Event, Finished, Job, Level, SamplingParams, Tokens
from workers.engine.engine import Engine
from workers.engine.spec.drafters import DraftModel
from workers.kernels import measure_widths

VOCAB = 260
EOS = (0,)
BURSTS = BurstSettings(k=3, audit_fraction=0.0, profile_steps=0, min_rounds=10**9)


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> Any:
    model = load(str(tiny_model))[0]
    measure_widths(model)
    return model


@pytest.fixture(autouse=True)
def clean_kernel_state() -> Iterator[None]:
    yield
    kernels.set_process_level(Level.WIDE)


def make_engine(target: Any, bursts: bool = False, **kw: Any) -> Engine:
    """An engine; with ``bursts``, a drafter that drafts the target itself, gated by a real probe."""
    engine = Engine(target, eos_token_ids=EOS, vocab_size=VOCAB, max_batch=8, **kw)
    if bursts:
        probed_bursts(engine, target, DraftModel(target, name="self"), BURSTS, "pause+self", VOCAB)
    return engine


class Run:
    """Drives an engine step by step and collects what each sequence received."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[int, list[int]] = {}
        self.ends: dict[int, Finished] = {}

    def take(self, events: list[Event]) -> list[Event]:
        for e in events:
            if isinstance(e, Tokens):
                assert e.seq not in self.ends, "tokens after the end"
                self.tokens.setdefault(e.seq, []).extend(e.tokens)
            elif isinstance(e, Finished):
                assert e.seq not in self.ends, "two ends for one sequence"
                self.ends[e.seq] = e
        return events

    def step(self) -> list[Event]:
        return self.take(self.engine.step())

    def until(self, done: Any, limit: int = 2000) -> None:
        for _ in range(limit):
            if done():
                return
            self.step()
        raise AssertionError("the engine did not get there")

    def finish(self) -> None:
        self.until(lambda: not self.engine.has_work)

    def count(self, seq: int) -> int:
        return len(self.tokens.get(seq, []))


def job(seq: int, prompt: list[int], n: int = 40, **kw: Any) -> Job:
    return Job(seq=seq, prompt=prompt, max_tokens=n, **kw)


PROMPTS = {1: [5, 6, 7], 2: [40, 41, 42, 43, 44, 45], 3: [100, 101]}


def uninterrupted(target: Any, jobs: list[Job]) -> dict[int, list[int]]:
    run = Run(make_engine(target))
    for j in jobs:
        run.engine.submit(j)
    run.finish()
    return run.tokens


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)])
def test_a_paused_sequence_gets_nothing_costs_no_decode_and_resumes_byte_identical(
    target: Any, sampling: SamplingParams
) -> None:
    jobs = [job(seq, p, n=40, sampling=sampling) for seq, p in PROMPTS.items()]
    want = uninterrupted(target, jobs)
    run = Run(make_engine(target))
    for j in jobs:
        run.engine.submit(j)
    run.until(lambda: run.count(2) >= 10)
    assert run.engine.pause(2) == []
    held = run.count(2)
    assert run.engine.paused == 1 and run.engine.active == 3 and run.engine.batch_size() == 2
    for _ in range(15):  # the others decode on; seq 2 is out of the batch
        run.step()
        assert run.count(2) == held and run.engine.batch_size() <= 2
    resumed = run.take(run.engine.resume(2))
    assert [e.tokens for e in resumed if isinstance(e, Tokens)] == [[want[2][held]]]  # its pending token
    assert run.engine.paused == 0
    run.finish()
    assert run.tokens == want
    assert {e.reason for e in run.ends.values()} == {"length"}


def test_a_lone_paused_sequence_leaves_no_work_and_resumes_identical(target: Any) -> None:
    (want,) = uninterrupted(target, [job(1, PROMPTS[1], n=30)]).values()
    run = Run(make_engine(target))
    run.engine.submit(job(1, PROMPTS[1], n=30))
    run.until(lambda: run.count(1) >= 5)
    run.engine.pause(1)
    steps = run.engine.counters.decode_steps
    assert not run.engine.has_work and run.engine.active == 1  # the loop may block: nothing to decode
    run.take(run.engine.resume(1))
    run.finish()
    assert run.tokens[1] == want
    assert run.engine.counters.decode_steps > steps


def test_a_pause_while_prefilling_takes_effect_when_the_sequence_reaches_decoding(target: Any) -> None:
    long_prompt = [(7 * i) % 250 + 3 for i in range(40)]
    jobs = [job(1, PROMPTS[1], n=60), job(2, long_prompt, n=20)]
    want = uninterrupted(target, jobs)
    run = Run(make_engine(target, prefill_step=8))  # the long prompt takes several steps
    run.engine.submit(jobs[0])
    run.until(lambda: run.count(1) >= 2)
    run.engine.submit(jobs[1])
    run.engine.pause(2)
    assert run.engine.has_work and run.engine.paused == 1
    run.until(lambda: run.engine._seqs[2].parked is not None)
    assert run.count(2) == 0  # it reached decoding and was parked before emitting anything
    for _ in range(5):
        run.step()
    assert run.count(2) == 0 and run.engine.batch_size() == 1
    run.take(run.engine.resume(2))
    run.finish()
    assert run.tokens == want


def test_cancel_of_a_paused_sequence_ends_it_once_and_resume_then_does_nothing(target: Any) -> None:
    run = Run(make_engine(target))
    run.engine.submit(job(1, PROMPTS[1], n=40))
    run.engine.submit(job(2, PROMPTS[2], n=40))
    run.until(lambda: run.count(2) >= 3)
    run.engine.pause(2)
    ends = run.take(run.engine.cancel(2))
    assert [(e.seq, e.reason) for e in ends if isinstance(e, Finished)] == [(2, "cancelled")]
    assert run.engine.paused == 0 and run.engine.active == 1
    assert run.engine.resume(2) == [] and run.engine.pause(2) == []  # finished: no-ops
    assert run.engine.resume(99) == [] and run.engine.pause(99) == []  # unknown: no-ops
    run.finish()
    assert run.ends[1].reason == "length" and run.count(2) == 3


def test_pausing_a_bursting_sequence_ends_its_burst_and_resume_stays_exact(target: Any) -> None:
    (want,) = uninterrupted(target, [job(1, PROMPTS[1], n=60)]).values()
    run = Run(make_engine(target, bursts=True))
    run.engine.submit(job(1, PROMPTS[1], n=60))
    run.until(lambda: run.engine.bursts.rounds >= 2)
    assert run.engine._burst is not None
    run.engine.pause(1)
    assert run.engine._burst is None and not run.engine.has_work
    held = run.count(1)
    run.take(run.engine.resume(1))
    assert run.count(1) == held + 1
    run.finish()
    assert run.tokens[1] == want


def test_a_paused_sequence_does_not_stop_the_lone_live_one_from_bursting(target: Any) -> None:
    jobs = [job(1, PROMPTS[1], n=80), job(2, PROMPTS[2], n=30)]
    want = uninterrupted(target, jobs)
    run = Run(make_engine(target, bursts=True))
    for j in jobs:
        run.engine.submit(j)
    run.until(lambda: run.count(2) >= 4 and run.count(1) >= 4)
    assert run.engine.bursts.rounds == 0  # two live sequences: contention
    run.engine.pause(2)
    held = run.count(2)
    run.until(lambda: run.engine.bursts.rounds >= 3)  # seq 1 is alone among the live ones
    assert run.count(2) == held and run.engine.active == 2
    run.take(run.engine.resume(2))
    run.finish()
    assert run.tokens == want
    assert run.engine.bursts.interrupted >= 1  # the resumed one ended the burst


# --------------------------------------------------------------------------- the engine thread


def test_engine_thread_pause_and_resume_commands(tiny_model: Path) -> None:
    with Thread(tiny_model) as t:
        t.engine.submit(job(1, PROMPTS[1], n=200))
        got: list[int] = []
        while len(got) < 3:
            signal = t.next()
            if isinstance(signal, Tokens):
                got += signal.tokens
        t.engine.pause(1)
        t.engine.submit(job(2, PROMPTS[2], n=5))  # handled after the pause: its end proves the pause is in
        while not (isinstance(signal := t.next(), Finished) and signal.seq == 2):
            if isinstance(signal, Tokens) and signal.seq == 1:
                got += signal.tokens
        held = len(got)
        snap = t.engine.snapshot()
        assert (snap["paused"], snap["active_sequences"], snap["batch_size"]) == (1, 1, 0)
        t.engine.resume(1)
        t.engine.resume(42)  # unknown: ignored
        while len(got) <= held:
            signal = t.next()
            if isinstance(signal, Tokens):
                got += signal.tokens
        assert t.engine.snapshot()["paused"] == 0
        t.engine.pause(1)
        t.engine.cancel(1)
        while not isinstance(signal := t.next(), Finished):
            pass
        assert (signal.seq, signal.reason) == (1, "cancelled")
        assert t.engine.snapshot()["active_sequences"] == 0


def test_the_probe_runs_while_every_sequence_is_paused(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe only runs while the engine has nothing to decode; paused sequences are nothing to decode."""
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path))  # no stored verdict: the probe must run
    t = Thread(tiny_model, draft="prompt-lookup", bursts=BurstSettings(k=2))
    t.engine.submit(job(1, PROMPTS[1], n=20))
    t.engine.pause(1)  # same drain as the submit, before any probe draw: parked once it decodes
    with t:
        deadline = time.monotonic() + 60
        while not [v for v in t.engine.snapshot()["verdicts"].values() if "level" in v]:
            assert time.monotonic() < deadline, "the probe did not run while the only sequence was paused"
            time.sleep(0.02)
        assert t.engine.snapshot()["paused"] == 1
        so_far = []
        while not t.out.empty():
            so_far.append(t.out.get_nowait())
        assert not [s for s in so_far if isinstance(s, (Tokens, Finished))]  # nothing while paused
        t.engine.resume(1)
        assert len(t.until_finished(1)) == 20
