"""What crosses the boundary to the engine process survives it exactly: commands (jobs), settings and
signals through ``workers.api``'s ``to_wire``/``from_wire``, and the wire's sampling options field by
field."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from clients.protocol import SamplingOptions
from scheduler.engine_process import pack, unpack
from workers.api import (
    BurstSettings,
    Dead,
    EngineSettings,
    Finished,
    FinishReason,
    Job,
    Level,
    ModelInfo,
    ProbePolicy,
    Ready,
    SamplingParams,
    Signal,
    StepInfo,
    StepKind,
    Stopped,
    SubmitJob,
    Timings,
    TokenMode,
    Tokens,
    from_wire,
    to_wire,
)


def job_to_wire(job: Job) -> dict[str, Any]:
    return to_wire(SubmitJob(job))["job"]  # type: ignore[no-any-return]


def job_from_wire(plain: dict[str, Any]) -> Job:
    cmd = from_wire("command", {"c": "submit", "job": plain})
    assert isinstance(cmd, SubmitJob)
    return cmd.job


def signal_to_wire(sig: Signal) -> dict[str, Any]:
    """One signal alone (a run of one plain token crosses as itself)."""
    (plain,) = to_wire([sig])
    return plain


def signal_from_wire(plain: dict[str, Any]) -> Signal:
    (sig,) = from_wire("signals", [plain])
    return sig


def test_what_crosses_the_boundary_comes_back_equal() -> None:
    job = Job(
        seq=7,
        prompt=[1, 2, 3],
        max_tokens=9,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.01, seed=2**62),
        stop_token_ids=(4, 5),
        logprobs=True,
        received_at=123.25,
        cache_salt="tenant-a",
        top_logprobs=20,
        group="c0ffee/g",
        group_size=3,
    )
    assert job_from_wire(unpack(pack(job_to_wire(job)))) == job
    settings = EngineSettings(
        max_batch=64,
        probe_k=4,
        drafter="prompt-lookup",
        probe_policy=ProbePolicy(allow_inexact=True, pinned_level=Level.NARROW),
        bursts=BurstSettings(k=6, audit_fraction=0.5),
    )
    assert from_wire("settings", unpack(pack(to_wire(settings)))) == settings
    info = ModelInfo("m", "/p", "llama", 300, 512, (0, 2), True, 4096)
    signals = [
        Tokens(3, [5, 6], [-0.5, -1.25], TokenMode.BURST),
        Tokens(3, [5, 6], [-0.5, -1.25], TokenMode.BATCHED, [[(5, -0.5), (9, -2.0)], [(6, -1.25), (5, -1.5)]]),
        StepInfo(StepKind.DECODE, 0.01, 4),
        Finished(3, FinishReason.ERROR, 4, 2, Timings(0.1, None, 0.2, 0.3), "engine_error", "boom"),
        Stopped(),
        Dead("trace"),
    ]
    for sig in signals:
        if isinstance(sig, (Tokens, StepInfo, Finished)):  # spelled out field by field: none left behind
            assert set(signal_to_wire(sig)) - {"t"} == {f.name for f in fields(sig)}
        back = signal_from_wire(unpack(pack(signal_to_wire(sig))))
        assert back == sig
        if isinstance(back, Finished):
            assert type(back.reason) is FinishReason
        if isinstance(back, Tokens):
            assert type(back.mode) is TokenMode
        if isinstance(back, StepInfo):
            assert type(back.kind) is StepKind
    ready = signal_from_wire(unpack(pack(signal_to_wire(Ready(info, "tok")))))
    # The tokenizer stays behind: the receiving process loads its own.
    assert isinstance(ready, Ready) and ready.info == info and ready.tokenizer is None


def test_a_plain_job_shares_no_list_with_its_job() -> None:
    """The plain map is built field by field (not deep-copied): its prompt and stop ids are still
    copies, so whoever holds the map (a plan, the command queue) cannot change the job."""
    job = Job(seq=1, prompt=[1, 2, 3], max_tokens=4, stop_token_ids=(7,))
    plain = job_to_wire(job)
    plain["prompt"].append(99)
    plain["stop_token_ids"].append(98)
    plain["sampling"]["temperature"] = 1.0
    assert job.prompt == [1, 2, 3] and job.stop_token_ids == (7,) and job.sampling.temperature == 0.0
    assert job_from_wire(job_to_wire(job)) == job


def test_the_engines_sampling_params_carry_every_wire_sampling_option() -> None:
    """The front end converts the wire's ``SamplingOptions`` to the engine's ``SamplingParams`` field by
    field: the two must have the same fields and defaults, except the wire's ``response_format``, which
    the front end compiles into the engine's ``grammar``; a job's sampling crosses to the engine process
    under the engine's names."""
    wire = {f.name: f.default for f in fields(SamplingOptions)}
    engine = {f.name: f.default for f in fields(SamplingParams)}
    assert wire.pop("response_format") is None and engine.pop("grammar") is None
    assert engine == wire
    assert job_to_wire(Job(seq=1, prompt=[1], max_tokens=1))["sampling"] == {**wire, "grammar": None}


def test_a_step_s_plain_tokens_cross_as_one_map_of_columns_in_order() -> None:
    """A decode step's one-token events travel as one map of columns (what keeps a B = 128 step's
    hand-over cheap); anything else between them splits the run and keeps its place, so every event
    comes back equal, typed and in order."""
    step = StepInfo(StepKind.DECODE, 0.03, 6)
    plain = [Tokens(seq, [100 + seq]) for seq in range(6)]
    wire = to_wire([step, *plain])
    assert [d["t"] for d in wire] == ["step", "tokens_run"]
    assert wire[1]["seq"] == list(range(6)) and wire[1]["token"] == [100 + s for s in range(6)]
    assert wire[1]["logprob"] is None

    end = Finished(2, FinishReason.LENGTH, 4, 3, Timings(0.1, 0.2, 0.3, 0.4))
    signals = [
        step,
        Tokens(1, [7], [-0.25]),
        Tokens(2, [8]),  # no logprobs next to one that has them
        end,
        Tokens(3, [9], [-1.0]),  # a run of one: as itself
        Tokens(4, [10, 11], [-0.5, -0.75], TokenMode.BURST),
        Tokens(5, [12], None, TokenMode.BATCHED, [[(12, -0.1), (13, -2.5)]]),
        Tokens(6, [14]),
        Tokens(7, [15]),
        Stopped(),
    ]
    wire = to_wire(signals)
    assert [d["t"] for d in wire] == [
        "step",
        "tokens_run",
        "finished",
        "tokens",
        "tokens",
        "tokens",
        "tokens_run",
        "stopped",
    ]
    back = from_wire("signals", unpack(pack({"events": wire}))["events"])
    assert back == signals
    assert all(type(s.mode) is TokenMode for s in back if isinstance(s, Tokens))
    assert from_wire("signals", to_wire([])) == []
