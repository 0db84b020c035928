"""``mlx-batchd serve`` across a real 2-rank ring group on this machine's CPU, through the client library.

One daemon started by ``mlx.launch`` exactly as the README says serves a workload once (the
module-scoped ``launched``/``launched_results``): greedy tokens equal to one process, cancel and
disconnect, then SIGTERM of rank 0 ending the whole launch. Ranks started by hand serve a second run
with the same bytes and run the probe and bursts on the split model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.distributed import (
    DEATH_TIMEOUT,
    LONG,
    MAX_TOKENS,
    PROMPTS,
    RUN_TIMEOUT,
    SERVE_OPTIONS,
    LaunchedDaemon,
    RankDaemon,
    _children,
    _ends,
    _gone,
    _stream_in_flight,
    _workload,
    linux_only,
)
from tests.helpers.distributed import models as models
from tests.helpers.distributed import ring as ring


@pytest.fixture(scope="module")
def launched(ring: None, models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedDaemon]:
    daemon = LaunchedDaemon(tmp_path_factory.mktemp("launched"), models["a"])
    try:
        daemon.wait_ready()
        yield daemon
    finally:
        daemon.close()


@pytest.fixture(scope="module")
def launched_results(launched: LaunchedDaemon) -> dict[str, Any]:
    return _workload(launched.address)


def test_two_ranks_serve_what_one_process_serves(
    launched: LaunchedDaemon, launched_results: dict[str, Any], models: dict[str, str], tmp_path: Path
) -> None:
    import numpy as np

    from tests.conftest import start_daemon

    one = start_daemon(models["a"], tmp_path / "one", *SERVE_OPTIONS)
    try:
        alone = _workload(one.address)
    finally:
        assert one.stop() == 0, one.log()
    two = launched_results
    assert "2 ranks, ring, tensor" in launched.output()
    assert two["engine"]["distributed"] == {"world_size": 2, "rank": 0, "backend": "ring", "mode": "tensor"}
    assert alone["engine"]["distributed"] == {"world_size": 1, "rank": 0, "backend": "single", "mode": "none"}
    # Greedy: the same tokens as one process. The logprobs are not the same bytes: each rank sums
    # half of every attention and MLP output and the ring adds the halves, which rounds differently
    # from one sum over the whole (float32 here).
    assert [g[0] for g in two["greedy"]] == [g[0] for g in alone["greedy"]]
    assert all(len(g[0]) == MAX_TOKENS or g[2] == "stop" for g in two["greedy"])
    diff = max(float(np.abs(np.array(a[1]) - np.array(b[1])).max()) for a, b in zip(two["greedy"], alone["greedy"]))
    print(f"daemon TP=2 vs one process: greedy tokens equal, max |logprob diff| {diff:.3g}")
    assert diff < 1e-4


def test_cancel_and_disconnect_behave_as_in_one_process(
    launched: LaunchedDaemon, launched_results: dict[str, Any]
) -> None:
    from clients import Client, TokenEvent

    with Client(launched.address, timeout=RUN_TIMEOUT) as c:
        events = []
        for event in c.stream(tokens=PROMPTS[0], max_tokens=LONG, request_id="cancel-me"):
            events.append(event)
            if isinstance(event, TokenEvent) and len(events) == 2:
                c.cancel("cancel-me")
        (end,) = _ends(events)
        assert end.finish_reason == "cancelled" and end.usage["completion_tokens"] < LONG
        for event in c.stream(tokens=PROMPTS[1], max_tokens=LONG):
            assert isinstance(event, TokenEvent)
            break  # leaving the stream cancels it
        deadline = time.monotonic() + DEATH_TIMEOUT
        while time.monotonic() < deadline:
            stats = c.stats()
            if stats["requests_in_flight"] == 0 and stats["engine"]["active_sequences"] == 0:
                break
            time.sleep(0.05)
        assert stats["requests_in_flight"] == 0 and stats["engine"]["active_sequences"] == 0
        # The ranks are still in step: the same greedy answer as before the cancels.
        again = c.generate(tokens=PROMPTS[0], max_tokens=MAX_TOKENS, logprobs=True)
    assert (again.tokens, again.logprobs) == tuple(launched_results["greedy"][0][:2])


@linux_only
def test_sigterm_of_rank_0_under_mlx_launch_ends_the_whole_launch(
    launched: LaunchedDaemon, launched_results: dict[str, Any]
) -> None:
    ranks = launched.ranks()
    assert sorted(ranks) == [0, 1], launched.output()
    (engine_process,) = _children(ranks[0])
    events, thread = _stream_in_flight(launched.address)
    os.kill(ranks[0], signal.SIGTERM)
    try:
        launched.proc.wait(DEATH_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"mlx.launch still runs {DEATH_TIMEOUT} s after SIGTERM:\n{launched.output()}") from None
    thread.join(DEATH_TIMEOUT)
    (end,) = _ends(events)
    assert end.error is not None and end.error.code == "shutdown", end
    assert _gone([*ranks.values(), engine_process]) == [], launched.output()


@linux_only
def test_a_second_run_is_identical_and_sigterm_of_rank_0_stops_every_rank(
    launched_results: dict[str, Any], models: dict[str, str], tmp_path: Path
) -> None:
    daemon = RankDaemon(tmp_path, [models["a"]] * 2)
    try:
        daemon.wait_ready()
        second = _workload(daemon.address)
        # Two runs of two ranks: the same tokens and the same logprob bytes, sampled ones included.
        assert second["greedy"] == launched_results["greedy"]
        assert second["sampled"] == launched_results["sampled"]
        (engine_process,) = _children(daemon.procs[0].pid)
        events, thread = _stream_in_flight(daemon.address)
        daemon.procs[0].send_signal(signal.SIGTERM)
        assert daemon.wait(0, DEATH_TIMEOUT) == 0, daemon.output()
        assert daemon.wait(1, DEATH_TIMEOUT) == 0, daemon.output()
        thread.join(DEATH_TIMEOUT)
        (end,) = _ends(events)
        assert end.finish_reason == "error" and end.error is not None and end.error.code == "shutdown", end
        assert _gone([engine_process]) == [], "the engine process outlived its daemon"
    finally:
        daemon.close()


def _verdict(address: str) -> dict[str, Any]:
    from clients import Client

    deadline = time.monotonic() + RUN_TIMEOUT
    with Client(address, timeout=RUN_TIMEOUT) as c:
        while time.monotonic() < deadline:
            done = [v for v in c.stats()["engine"]["verdicts"].values() if "level" in v]
            if done:
                return done[0]
            time.sleep(0.1)
    raise AssertionError("no verdict")


@linux_only
def test_the_probe_and_bursts_run_on_the_sharded_model(
    launched_results: dict[str, Any], models: dict[str, str], tmp_path: Path, private_cache: Path
) -> None:
    """The probe runs on the split model (its verdict stored per world size and split, and read back
    by the next start for every rank: rank 1 has a fresh cache of its own each time, as on another
    machine, and never holds the verdict), and a lone greedy request bursts on it."""
    from clients import Client

    found = []
    for run in ("probed", "stored"):
        envs = [{}, {"MLX_BATCHD_CACHE": str(tmp_path / f"rank1-cache-{run}")}]
        daemon = RankDaemon(tmp_path / run, [models["a"]] * 2, "--draft", "prompt-lookup", "-k", "3", envs=envs)
        try:
            daemon.wait_ready()
            verdict = _verdict(daemon.address)
            with Client(daemon.address, timeout=RUN_TIMEOUT) as c:
                r = c.generate(tokens=PROMPTS[0], max_tokens=MAX_TOKENS, logprobs=True)
                bursts = c.stats()["engine"]["bursts"]
            found.append(verdict["from_cache"])
            assert verdict["level"] is not None, verdict  # the CPU backend's sums are exact at wide
            assert r.tokens == launched_results["greedy"][0][0]
            assert bursts["rounds"] > 0 and bursts["audit_failures"] == 0, bursts
            daemon.procs[0].send_signal(signal.SIGTERM)
            assert [daemon.wait(r, DEATH_TIMEOUT) for r in range(2)] == [0, 0], daemon.output()
        finally:
            daemon.close()
    assert found == [False, True]
    stored = [json.loads(f.read_text())["pairing"] for f in (private_cache / "verdicts").glob("*.json")]
    assert {"world_size": 2, "backend": "ring", "mode": "tensor"} in [p.get("distributed") for p in stored]
    assert not list(tmp_path.glob("rank1-cache-*/verdicts"))
