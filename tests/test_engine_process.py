"""The engine in its own process: what crosses the boundary survives it exactly, a dead engine
process ends every request with ``engine_dead`` and the daemon with a non-zero exit, and an engine
process whose daemon died does not outlive it. Real daemons, real processes, the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from clients import Client
from clients.protocol import SamplingOptions
from scheduler.engine_process import (
    job_from_wire,
    job_to_wire,
    pack,
    settings_from_wire,
    settings_to_wire,
    signal_from_wire,
    signal_to_wire,
    unpack,
)
from tests.conftest import start_daemon
from tests.reference import greedy_reference
from workers.burst import BurstSettings
from workers.engine import Finished, Job, StepInfo, Timings, Tokens
from workers.kernels import Level
from workers.loop import Dead, EngineSettings, Ready, Stopped
from workers.models import ModelInfo
from workers.params import FinishReason, SamplingParams
from workers.probe import ProbePolicy

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds child processes through /proc")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_what_crosses_the_boundary_comes_back_equal() -> None:
    job = Job(
        seq=7,
        prompt=[1, 2, 3],
        max_tokens=9,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.01, seed=2**62),
        stop_token_ids=(4, 5),
        logprobs=True,
        received_at=123.25,
        top_logprobs=20,
    )
    assert job_from_wire(unpack(pack(job_to_wire(job)))) == job
    settings = EngineSettings(
        max_batch=64,
        probe_k=4,
        drafter="prompt-lookup",
        probe_policy=ProbePolicy(allow_inexact=True, pinned_level=Level.NARROW),
        bursts=BurstSettings(k=6, audit_fraction=0.5),
        tax_interval_s=0.0,
    )
    assert settings_from_wire(unpack(pack(settings_to_wire(settings)))) == settings
    info = ModelInfo("m", "/p", "llama", 300, 512, (0, 2), True, 4096)
    signals = [
        Tokens(3, [5, 6], [-0.5, -1.25], "burst"),
        Tokens(3, [5, 6], [-0.5, -1.25], "batched", [[(5, -0.5), (9, -2.0)], [(6, -1.25), (5, -1.5)]]),
        StepInfo("decode", 0.01, 4),
        Finished(3, FinishReason.ERROR, 4, 2, Timings(0.1, None, 0.2, 0.3), "engine_error", "boom"),
        Stopped(),
        Dead("trace"),
    ]
    for sig in signals:
        back = signal_from_wire(unpack(pack(signal_to_wire(sig))), lambda i: None)
        assert back == sig
        if isinstance(back, Finished):
            assert type(back.reason) is FinishReason
    ready = signal_from_wire(unpack(pack(signal_to_wire(Ready(info, "tok")))), lambda i: f"tokenizer of {i.name}")
    assert isinstance(ready, Ready) and ready.info == info and ready.tokenizer == "tokenizer of m"


def test_the_engines_sampling_params_carry_every_wire_sampling_option() -> None:
    """The front end converts the wire's ``SamplingOptions`` to the engine's ``SamplingParams`` field by
    field: the two must have the same fields and defaults, and a job's sampling crosses to the engine
    process under the wire's names."""
    wire = {f.name: f.default for f in fields(SamplingOptions)}
    assert {f.name: f.default for f in fields(SamplingParams)} == wire
    assert job_to_wire(Job(seq=1, prompt=[1], max_tokens=1))["sampling"] == wire


@linux_only
def test_the_engine_runs_in_a_child_and_serves_exactly(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path)
    try:
        children = _children(d.proc.pid)
        assert len(children) == 1, children
        with Client(d.address, timeout=60) as c:
            r = c.generate(tokens=[5, 6, 7], max_tokens=12)
            assert r.tokens == greedy_reference(tiny_model, [5, 6, 7], 12)[0]
            # The snapshot crossed with the end: nothing is left running once the end is read.
            assert c.stats()["engine"]["active_sequences"] == 0
    finally:
        assert d.stop() == 0, d.log()
    assert not any(_alive(p) for p in children)


@linux_only
def test_a_killed_engine_process_ends_every_request_and_the_daemon(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path)
    try:
        (child,) = _children(d.proc.pid)
        with Client(d.address, timeout=60) as c:
            stream = c.stream(tokens=[5, 6, 7], max_tokens=4000)
            next(iter(stream))  # running
            os.kill(child, signal.SIGKILL)
            events = list(stream)
        end = events[-1]
        assert end.finish_reason == "error" and end.error is not None and end.error.code == "engine_dead", end
        assert d.proc.wait(timeout=30) == 1
        assert "engine process exited with code -9" in d.log()
    finally:
        d.stop()


@linux_only
def test_an_engine_process_does_not_outlive_its_daemon(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path)
    (child,) = _children(d.proc.pid)
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while _alive(child):
        assert time.monotonic() < deadline, "the engine process outlived its daemon"
        time.sleep(0.1)


@linux_only
def test_engine_thread_keeps_the_engine_in_the_daemon(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path, "--engine-thread")
    try:
        assert _children(d.proc.pid) == []
        with Client(d.address, timeout=60) as c:
            assert c.generate(tokens=[5, 6, 7], max_tokens=8).tokens == greedy_reference(tiny_model, [5, 6, 7], 8)[0]
    finally:
        assert d.stop() == 0, d.log()
