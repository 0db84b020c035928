"""The logits controls' wire fields, ``n``'s expansion and the processors they become."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import msgpack
import pytest

from clients.messages import submit_message
from clients.parse import expand_n, parse_request
from clients.protocol import MAX_N, ErrorCode, ProtocolError, SamplingOptions, Submit
from workers.api import Job, SamplingParams, SubmitJob, from_wire, to_wire
from workers.engine.logits_controls import processors_for, stop_ids

BASE = {"v": 1, "type": "submit", "id": "r", "tokens": [1, 2]}


def parsed(**fields: Any) -> Submit:
    req = parse_request({**BASE, **fields})
    assert isinstance(req, Submit)
    return req


def test_controls_round_trip_through_the_wire() -> None:
    options = SamplingOptions(
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.3,
        logit_bias=((5, 10.0), (7, -100.0)),
        min_tokens=3,
        ignore_eos=True,
    )
    req = Submit(id="r", tokens=[1, 2], max_tokens=8, sampling=options)
    wire = msgpack.unpackb(msgpack.packb(submit_message(req)), strict_map_key=True)
    assert wire["logit_bias"] == {"5": 10.0, "7": -100.0}
    assert parse_request(wire) == req


def test_a_plain_submit_has_no_controls_and_sends_none() -> None:
    req = parsed()
    assert not req.sampling.has_processors and not req.sampling.ignore_eos
    assert not {"presence_penalty", "logit_bias", "min_tokens", "ignore_eos"} & set(submit_message(req))
    assert parsed(repetition_penalty=1).sampling.repetition_penalty is None  # 1 multiplies nothing


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"+1": 1}}, "logit_bias"),
        ({"logit_bias": {"1": True}}, "logit_bias"),
        ({"logit_bias": {"1": 10**400}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"n": 3}, "n"),
    ],
)
def test_bad_values_name_their_field(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request({**BASE, **fields})
    assert info.value.code == ErrorCode.BAD_FIELD and f"'{named}'" in info.value.message


def test_expand_n_gives_grouped_seeded_siblings() -> None:
    req = parsed(seed=7, temperature=1.0)
    subs = expand_n(req, 3)
    assert [s.id for s in subs] == ["r/0", "r/1", "r/2"]
    assert [s.sampling.seed for s in subs] == [7, 8, 9]
    assert {s.group for s in subs} == {("r", 3)}
    assert expand_n(req, 1) == [req]
    assert [s.sampling.seed for s in expand_n(parsed(), 2)] == [None, None]
    for bad in (0, MAX_N + 1, True, 2.0):
        with pytest.raises(ProtocolError, match="'n'"):
            expand_n(req, bad)  # type: ignore[arg-type]


def test_sampling_params_cross_a_plan_as_plain_data() -> None:
    sampling = SamplingParams(repetition_penalty=1.2, logit_bias=((3, 1.5),), min_tokens=2, ignore_eos=True)
    job = Job(seq=1, prompt=[1, 2], max_tokens=4, sampling=sampling)
    plain = msgpack.unpackb(msgpack.packb(to_wire(SubmitJob(job))), strict_map_key=False)
    assert from_wire("command", plain) == SubmitJob(job)


def test_plain_requests_get_no_processors() -> None:
    assert processors_for(SamplingParams(temperature=0.7, top_k=5), 4, {0}) == []
    assert processors_for(SamplingParams(ignore_eos=True), 4, {0}) == []
    assert stop_ids(SamplingParams(ignore_eos=True), (0,), (9,)) == frozenset({9})
    assert stop_ids(SamplingParams(), (0,), (9,)) == frozenset({0, 9})


def test_min_tokens_suppresses_the_stop_tokens_until_enough_are_out() -> None:
    (proc,) = processors_for(SamplingParams(min_tokens=2), prompt_len=3, stops={0, 4})
    logits = mx.zeros((1, 6))
    for emitted, suppressed in ((0, True), (1, True), (2, False)):
        out = proc(mx.zeros((3 + emitted,), dtype=mx.int32), logits)
        assert (out[0, 0].item() == -float("inf")) is suppressed
        assert (out[0, 4].item() == -float("inf")) is suppressed
        assert out[0, 1].item() == 0.0


def test_the_engine_gives_processors_only_to_controlled_requests_and_none_declines_bursts(tiny_model: Any) -> None:
    from mlx_lm import load

    from workers.engine.engine import Engine

    engine = Engine(load(str(tiny_model))[0], eos_token_ids=(0,), vocab_size=260)
    engine.submit(Job(seq=1, prompt=[5, 6, 7], max_tokens=4))
    engine.submit(Job(seq=2, prompt=[5, 6, 7], max_tokens=4, sampling=SamplingParams(presence_penalty=1.0)))
    engine.submit(Job(seq=3, prompt=[5, 6, 7], max_tokens=4, sampling=SamplingParams(ignore_eos=True)))
    plain, controlled, no_eos = (engine._seqs[i] for i in (1, 2, 3))
    assert plain.processors == [] and plain.no_burst is None
    assert len(controlled.processors) == 1 and controlled.no_burst is None
    assert no_eos.processors == [] and no_eos.no_burst is None and no_eos.stops == frozenset()
    while engine.has_work:
        engine.step()


def _drive(engine: Any, jobs: list[Job]) -> dict[int, list[int]]:
    from workers.api import Tokens

    for j in jobs:
        engine.submit(j)
    out: dict[int, list[int]] = {j.seq: [] for j in jobs}
    while engine.has_work:
        for e in engine.step():
            if isinstance(e, Tokens):
                out[e.seq] += e.tokens
    return out


def test_n_siblings_share_one_prefill_through_the_prefix_cache(tiny_model: Any) -> None:
    """Siblings of one request (one group, one prompt) prefill once: the leader's prompt KV reaches the
    prefix cache at its first token and each follower takes it, with the tokens a fresh prefill gives."""
    from mlx_lm import load

    from workers.api import Finished, Tokens
    from workers.engine.engine import Engine
    from workers.engine.prefix_cache import PrefixCache
    from workers.engine.prefix_check import ReuseVerdict

    model = load(str(tiny_model))[0]
    prompt = [5 + i % 50 for i in range(40)]

    def engine() -> Engine:
        e = Engine(model, eos_token_ids=(0,), vocab_size=260)
        e.prefix_cache = PrefixCache(1 << 26, ReuseVerdict(exact=True, reason="test"))
        return e

    def jobs(group: str | None) -> list[Job]:
        return [
            Job(
                seq=i,
                prompt=prompt,
                max_tokens=10,
                sampling=SamplingParams(temperature=1.0, seed=3 + i),
                cache_salt="t",
                group=group,
                group_size=3 if group else 0,
            )
            for i in range(3)
        ]

    shared = engine()
    got = _drive(shared, jobs("g"))
    pc = shared.prefix_cache
    assert pc is not None and pc.counters.hits == 2 and pc.counters.hit_tokens == 2 * (len(prompt) - 1)
    alone = engine()
    assert got == _drive(alone, jobs(None))
    assert alone.prefix_cache is not None and alone.prefix_cache.counters.hits == 0

    # A waiting follower cancelled, then the leader cancelled before its first token: the follower
    # left goes in on its own and finishes as it would have.
    e = engine()
    for j in jobs("g"):
        e.submit(j)
    assert len(e.shared) == 2
    ends = e.cancel(1) + e.cancel(0)
    assert [(f.seq, f.reason) for f in ends if isinstance(f, Finished)] == [(1, "cancelled"), (0, "cancelled")]
    assert len(e.shared) == 1
    rest: list[int] = []
    while e.has_work:
        rest += [t for ev in e.step() if isinstance(ev, Tokens) and ev.seq == 2 for t in ev.tokens]
    assert rest == got[2] and len(e.shared) == 0
