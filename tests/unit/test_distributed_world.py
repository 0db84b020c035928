"""``workers.dist`` in one process, without a group: the backend ``mlx.launch`` set up, and a
single process that needs no collective."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_launched_backend_reads_what_mlx_launch_sets(tmp_path: Path) -> None:
    from workers.dist import launched_backend

    hosts = tmp_path / "hosts.json"
    hosts.write_text('[["127.0.0.1:1"], ["127.0.0.1:2"]]')
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert launched_backend({}) is None
    assert launched_backend({"MLX_RANK": "1", "MLX_HOSTFILE": str(hosts)}) == "ring"
    assert launched_backend({"MLX_RANK": "0", "MLX_HOSTFILE": str(empty)}) is None  # mlx.launch -n 1
    assert launched_backend({"MLX_RANK": "0", "NCCL_HOST_IP": "10.0.0.1", "MLX_WORLD_SIZE": "2"}) == "nccl"
    assert launched_backend({"MLX_RANK": "0", "MLX_JACCL_COORDINATOR": "10.0.0.1:1"}) == "jaccl"


def test_one_process_needs_no_group() -> None:
    from workers.api import Cancel
    from workers.dist import Broadcaster, DistributedError, Lockstep, Plan, World

    world = World.from_env(env={})
    assert world == World.single() and not world.distributed and world.leader
    assert Broadcaster(world)({"a": 1}) == {"a": 1}
    lockstep = Lockstep(world)
    plan = lockstep.publish([Cancel(1, "cancelled", None, None)], {"burst": True}, wait_s=0.5)
    assert Plan.from_wire(plan.to_wire()) == plan and lockstep.iteration == 1
    with pytest.raises(DistributedError):
        lockstep.receive()


def test_one_rank_converts_no_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, a plan's commands stay the objects rank 0 decided: no codec runs (the conversion to
    plain maps is for crossing to other ranks), so a submit's prompt is not copied per iteration."""
    import workers.api.wire as wire
    from workers.api import Job, SubmitJob
    from workers.dist import Lockstep, World

    calls: list[object] = []
    real = wire._command_to_wire
    monkeypatch.setattr(wire, "_command_to_wire", lambda cmd: calls.append(cmd) or real(cmd))
    cmd = SubmitJob(Job(seq=1, prompt=[1, 2, 3], max_tokens=4))
    plan = Lockstep(World.single()).publish([cmd])
    assert plan.commands[0] is cmd and calls == []
    plan.to_wire()  # what crossing to another rank would run: the counter sees it
    assert calls == [cmd]
