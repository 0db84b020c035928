"""``workers.dist`` on a real 2-rank ring group on this machine's CPU: set-ups refused, and
ranks that die, stop answering, are stopped or never meet their peers.

Every rank must end on its own, in one line and with the right exit status, never hang: the rank
program (``tests.helpers.rank_program``) for the group itself, ``mlx-batchd serve`` for the daemon.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.distributed import (
    DEATH_TIMEOUT,
    ROOT,
    RUN_TIMEOUT,
    RankDaemon,
    Ranks,
    _children,
    _ends,
    _free_ports,
    _gone,
    _kill_group,
    _launcher,
    _rank_command,
    _spec,
    _stream_in_flight,
    launch,
    linux_only,
)
from tests.helpers.distributed import models as models
from tests.helpers.distributed import ring as ring


def test_ranks_with_different_weights_stop_with_one_line(ring: None, models: dict[str, str], tmp_path: Path) -> None:
    results, output = launch("load", tmp_path, models=[models["a"], models["b"]])
    for r in results:
        assert r["kind"] == "ShardError"
        assert "the ranks loaded different weights" in r["error"] and "rank 1 has" in r["error"]
        assert "\n" not in r["error"]
    assert output.count("mlx-batchd: the ranks loaded different weights") == 2, output


def test_a_world_size_that_does_not_divide_the_heads_stops_with_one_line(
    ring: None, models: dict[str, str], tmp_path: Path
) -> None:
    # Ranks started by hand: under mlx.launch the first rank to fail gets the other one SIGTERMed,
    # sometimes before it has written its own answer.
    ranks = Ranks("load", tmp_path, model=models["one_kv_head"])
    try:
        for rank in range(2):
            ranks.wait(rank, RUN_TIMEOUT)
        results = [ranks.result(rank) for rank in range(2)]
        output = ranks.output()
    finally:
        ranks.close()
    for r in results:
        assert r["kind"] == "ShardError"
        assert "num_key_value_heads=1 is not divisible by the world size 2" in r["error"]
        assert "'llama'" in r["error"] and "\n" not in r["error"]
    assert "Traceback" not in output


@pytest.fixture()
def serving(ring: None, models: dict[str, str], tmp_path: Path) -> Iterator[Ranks]:
    ranks = Ranks("serve", tmp_path, model=models["a"])
    try:
        ranks.wait_ready()
        yield ranks
    finally:
        ranks.close()


@pytest.mark.parametrize("dead", [0, 1])
def test_a_dead_rank_makes_the_other_exit_non_zero(serving: Ranks, dead: int) -> None:
    survivor = 1 - dead
    os.kill(serving.result(dead)["pid"], signal.SIGKILL)
    code = serving.wait(survivor, DEATH_TIMEOUT)
    assert code != 0, serving.output()
    # PeerLost / RuntimeError: the survivor's collective failed; RankTimeout: it waited in MLX's ring
    # for good and the serve loop's watchdog ended it (the daemon's ``--rank-timeout`` does the same).
    assert serving.result(survivor)["kind"] in ("PeerLost", "RuntimeError", "RankTimeout"), serving.output()


def test_sigterm_of_rank_0_stops_every_rank_cleanly(serving: Ranks) -> None:
    time.sleep(0.5)  # some plans go by first
    os.kill(serving.result(0)["pid"], signal.SIGTERM)
    assert serving.wait(0, DEATH_TIMEOUT) == 0, serving.output()
    assert serving.wait(1, DEATH_TIMEOUT) == 0, serving.output()
    leader, follower = serving.result(0), serving.result(1)
    assert leader["stopped_by"] == "sigterm"
    assert follower["applied"] == leader["applied"] > 0


def test_a_rank_killed_under_mlx_launch_does_not_hang_the_launcher(
    ring: None, models: dict[str, str], tmp_path: Path
) -> None:
    spec_path, out = _spec(tmp_path, model=models["a"])
    proc = _launcher("serve", tmp_path, spec_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not all((out / f"rank{r}.json").exists() for r in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not get ready"
            time.sleep(0.1)
        os.kill(json.loads((out / "rank1.json").read_text())["pid"], signal.SIGKILL)
        proc.wait(DEATH_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"mlx.launch still runs {DEATH_TIMEOUT} s after rank 1 died") from None
    finally:
        _kill_group(proc)


@linux_only
@pytest.mark.parametrize("dead", [1, 0], ids=["follower", "daemon"])
def test_a_dead_rank_ends_every_request_and_every_rank(models: dict[str, str], tmp_path: Path, dead: int) -> None:
    """A follower killed: the daemon ends every request ``engine_dead`` and exits 1, as when one
    process's engine dies (within ``--rank-timeout`` where the ring's collective never returns). The daemon killed: the
    kernel kills its engine process (parent-death signal) and the follower, its peer lost, exits 1
    (the clients see ``daemon_gone``, as from any daemon killed)."""
    daemon = RankDaemon(tmp_path, [models["a"]] * 2, "--rank-timeout", "10")
    try:
        daemon.wait_ready()
        (engine_process,) = _children(daemon.procs[0].pid)
        events, thread = _stream_in_flight(daemon.address)
        daemon.procs[dead].kill()
        assert daemon.wait(1 - dead, DEATH_TIMEOUT) == 1, daemon.output()
        thread.join(DEATH_TIMEOUT)
        if dead:
            (end,) = _ends(events)
            assert end.finish_reason == "error" and end.error is not None and end.error.code == "engine_dead", end
        else:
            assert getattr(events[-1], "code", None) == "daemon_gone", events[-1:]
        assert _gone([engine_process]) == [], daemon.output()
        # A ring collective whose peer died mid-transfer may wait for good (mlx 0.32.4 left 3 of 10
        # such kills waiting): then the watchdog (--rank-timeout) ends the rank instead.
        assert any(s in daemon.output() for s in ("group broke", "rank_timeout")), daemon.output()
        assert "Traceback" not in daemon.output(), daemon.output()
    finally:
        daemon.close()


@linux_only
def test_a_stuck_rank_is_given_up_after_the_rank_timeout(models: dict[str, str], tmp_path: Path) -> None:
    """A follower that stops answering without dying (here SIGSTOP) leaves rank 0 inside a
    collective that never returns and raises nothing; past --rank-timeout the daemon ends every
    request ``engine_dead`` and exits 1."""
    daemon = RankDaemon(tmp_path, [models["a"]] * 2, "--rank-timeout", "3")
    try:
        daemon.wait_ready()
        (engine_process,) = _children(daemon.procs[0].pid)
        events, thread = _stream_in_flight(daemon.address)
        daemon.procs[1].send_signal(signal.SIGSTOP)
        assert daemon.wait(0, DEATH_TIMEOUT) == 1, daemon.output()
        thread.join(DEATH_TIMEOUT)
        (end,) = _ends(events)
        assert end.error is not None and end.error.code == "engine_dead", end
        assert _gone([engine_process]) == [], daemon.output()
        assert "ran past 3 s (rank_timeout in the config file)" in daemon.output(), daemon.output()
    finally:
        daemon.close()  # SIGKILL ends the stopped follower too


@linux_only
def test_a_set_up_that_cannot_serve_is_refused_on_every_rank(models: dict[str, str], tmp_path: Path) -> None:
    """Heads that do not divide: refused before anything is bound, on each rank, exit 2. Different
    weights: found when the ranks meet, every rank stops non-zero saying so, no traceback."""
    heads = RankDaemon(tmp_path / "heads", [models["one_kv_head"]] * 2)
    weights = RankDaemon(tmp_path / "weights", [models["a"], models["b"]])
    try:
        assert [heads.wait(r, RUN_TIMEOUT) for r in range(2)] == [2, 2], heads.output()
        lines = [line for line in heads.output().splitlines() if line.startswith("mlx-batchd serve:")]
        assert len(lines) == 2 and all("num_key_value_heads=1 is not divisible by the world size 2" in x for x in lines)
        assert not (tmp_path / "heads" / "d.sock").exists()
        assert [weights.wait(r, RUN_TIMEOUT) for r in range(2)] == [1, 1], weights.output()
        assert weights.output().count("the ranks loaded different weights") == 2, weights.output()
        assert "Traceback" not in heads.output() + weights.output()
    finally:
        heads.close()
        weights.close()


def test_a_rank_whose_peers_never_join_stops_at_the_join_timeout(
    ring: None, models: dict[str, str], tmp_path: Path
) -> None:
    """``mx.distributed.init`` waits for the ring's peers for good, holding the GIL: without the
    alarm a rank started by hand whose partner refused its set-up would wait forever."""
    spec_path, _ = _spec(tmp_path, model=models["a"], join_timeout=2)
    hostfile = tmp_path / "hosts.json"
    port = _free_ports()
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = {**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)}
    alone = subprocess.Popen(_rank_command("load", spec_path), cwd=ROOT, env=env, start_new_session=True)
    try:
        assert alone.wait(DEATH_TIMEOUT) == -signal.SIGALRM
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a rank alone still waits {DEATH_TIMEOUT} s later") from None
    finally:
        _kill_group(alone)
