"""``workers.distributed`` in one process, without a group: the backend ``mlx.launch`` set up, and a
single process that needs no collective."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_launched_backend_reads_what_mlx_launch_sets(tmp_path: Path) -> None:
    from workers.distributed import launched_backend

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
    from workers.distributed import Broadcaster, DistributedError, Lockstep, Plan, World

    world = World.from_env(env={})
    assert world == World.single() and not world.distributed and world.leader
    assert Broadcaster(world)({"a": 1}) == {"a": 1}
    lockstep = Lockstep(world)
    plan = lockstep.publish([{"c": "cancel", "seq": 1}], {"burst": True}, wait_s=0.5)
    assert Plan.from_wire(plan.to_wire()) == plan and lockstep.iteration == 1
    with pytest.raises(DistributedError):
        lockstep.receive()
