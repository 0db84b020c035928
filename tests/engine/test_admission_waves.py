"""Admission waves on the real engine loop (``EngineThread``, tiny model): arrivals that land while a
batch decodes are held and join together; an idle engine, a cancel, or a batch that runs dry lets
them in at once; what each request gets is what it gets without the hold."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load

from tests.helpers.engine_thread import EngineThreadRun
from workers.api import Finished, Job, Tokens
from workers.engine.engine import Engine

HOUR = 3600.0  # a window no test waits out: a hold that should have ended shows as a 30 s timeout
PROMPTS = {1: [5, 6, 7], 2: [40, 41, 42, 43, 44, 45], 3: [100, 101], 4: [7, 7, 9, 11]}


def job(seq: int, n: int) -> Job:
    return Job(seq=seq, prompt=PROMPTS[seq], max_tokens=n)


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> Any:
    return load(str(tiny_model))[0]


def alone(target: Any, j: Job) -> list[int]:
    """The job's tokens on an engine of its own."""
    engine = Engine(target, eos_token_ids=(), vocab_size=260)
    engine.submit(j)
    out: list[int] = []
    while engine.has_work:
        out += [t for e in engine.step() if isinstance(e, Tokens) for t in e.tokens]
    return out


def held(t: EngineThreadRun, n: int) -> None:
    """Wait until the loop holds ``n`` arrivals."""
    deadline = time.monotonic() + 30
    while t.engine.snapshot()["admission"]["held"] != n:
        assert time.monotonic() < deadline, f"the loop never held {n} arrivals"
        time.sleep(0.005)


def collect(t: EngineThreadRun, seqs: set[int]) -> tuple[dict[int, list[int]], dict[int, Any]]:
    """Every token and end until ``seqs`` have all ended."""
    tokens: dict[int, list[int]] = {}
    ends: dict[int, Any] = {}
    while not seqs <= ends.keys():
        s = t.next()
        if isinstance(s, Tokens):
            tokens.setdefault(s.seq, []).extend(s.tokens)
        elif isinstance(s, Finished):
            ends[s.seq] = s
    return tokens, ends


def one_held_behind(t: EngineThreadRun, running: Job, arriving: Job) -> None:
    """``running`` decodes, then ``arriving`` comes and is held."""
    t.engine.submit(running)
    first_tokens(t, running.seq)
    t.engine.submit(arriving)
    held(t, 1)


def first_tokens(t: EngineThreadRun, seq: int) -> list[int]:
    while not (isinstance(s := t.next(), Tokens) and s.seq == seq):
        pass
    return list(s.tokens)


def test_arrivals_mid_batch_join_as_one_wave_and_get_what_they_get_alone(tiny_model: Path, target: Any) -> None:
    with EngineThreadRun(tiny_model, prefill_batch=3, admit_window_s=HOUR, admit_idle_window_s=0) as t:
        t.engine.submit(job(1, 400))
        got = {1: first_tokens(t, 1)}  # the engine is busy with seq 1 from here
        t.engine.submit(job(2, 12))
        t.engine.submit(job(3, 12))
        held(t, 2)
        t.engine.submit(job(4, 12))  # the third makes a full wave
        tokens, ends = collect(t, {2, 3, 4})
        assert t.engine.snapshot()["admission"] == {
            "window_ms": HOUR * 1e3,
            "idle_window_ms": 0.0,
            "held": 0,
            "delayed": 2,
            "idle_hold_seconds": 0.0,  # held by a busy engine only
        }
        t.engine.cancel(1)
        rest, _ = collect(t, {1})
    got[1] += tokens.get(1, []) + rest.get(1, [])
    for seq in (2, 3, 4):
        assert ends[seq].reason == "length"
        assert tokens[seq] == alone(target, job(seq, 12)), seq
    assert got[1] == alone(target, job(1, 400))[: len(got[1])]


def test_without_an_idle_window_an_idle_engine_admits_at_once(tiny_model: Path) -> None:
    with EngineThreadRun(tiny_model, admit_window_s=HOUR, admit_idle_window_s=0) as t:
        t.engine.submit(job(2, 6))
        tokens, ends = collect(t, {2})
        assert ends[2].reason == "length" and len(tokens[2]) == 6
        assert t.engine.snapshot()["admission"]["delayed"] == 0


def test_held_arrivals_start_when_the_batch_runs_dry(tiny_model: Path, target: Any) -> None:
    """The engine goes idle with an arrival held: the loop must not wait for a command then."""
    with EngineThreadRun(tiny_model, admit_window_s=HOUR) as t:
        one_held_behind(t, job(1, 300), job(2, 6))
        tokens, ends = collect(t, {1, 2})
        assert (ends[1].reason, ends[2].reason) == ("length", "length")
        assert tokens[2] == alone(target, job(2, 6))


def test_a_held_arrival_can_be_cancelled(tiny_model: Path) -> None:
    with EngineThreadRun(tiny_model, admit_window_s=HOUR) as t:
        one_held_behind(t, job(1, 40), job(2, 400))
        t.engine.cancel(2)
        tokens, ends = collect(t, {1, 2})
        assert (ends[1].reason, ends[2].reason) == ("length", "cancelled")
        assert 2 not in tokens or len(tokens[2]) < 400
        assert t.engine.snapshot()["active_sequences"] == 0


def test_an_idle_window_gathers_clients_that_start_together_into_one_wave(tiny_model: Path, target: Any) -> None:
    with EngineThreadRun(tiny_model, prefill_batch=3, admit_idle_window_s=HOUR) as t:
        t.engine.submit(job(2, 6))
        held(t, 1)  # the engine is idle, yet it waits for others
        t.engine.submit(job(3, 6))
        held(t, 2)
        t.engine.submit(job(4, 6))  # a full wave goes in at once
        tokens, ends = collect(t, {2, 3, 4})
        snap = t.engine.snapshot()
    assert snap["admission"]["delayed"] == 2 and snap["prefill_steps"] == 2  # one wave: its chunk, its last token
    assert snap["admission"]["idle_hold_seconds"] > 0  # the idle engine waited for the others
    for seq in (2, 3, 4):
        assert (ends[seq].reason, tokens[seq]) == ("length", alone(target, job(seq, 6))), seq


def test_an_idle_window_ends_without_another_arrival(tiny_model: Path) -> None:
    """The loop must wake when the window ends, not wait for a command that may never come."""
    with EngineThreadRun(tiny_model, admit_idle_window_s=0.3) as t:
        tic = time.monotonic()
        t.engine.submit(job(2, 6))
        tokens, ends = collect(t, {2})
        waited = time.monotonic() - tic
    assert ends[2].reason == "length" and len(tokens[2]) == 6
    assert waited >= 0.3  # held for the window (an upper bound would be a timing assertion)
