"""One model over several processes with ``mlx.distributed``: the group, broadcasts, sharding, lockstep.

``mlx.launch`` starts the same command once per rank (``mlx.launch --backend ring -n 2 -- CMD`` on one
machine's CPUs; ``--backend nccl`` on a multi-GPU host; ``--hostfile`` for several machines) and tells
each process its rank through the environment. Every rank loads the model, shards it with mlx-lm's own
tensor-parallel ``shard()`` (or ``model.model.pipeline()`` for families that only have that), and then
runs the same forwards in the same order: each forward contains collectives, so a rank that skips or
adds one stalls or corrupts the others. Rank 0 alone decides what the next engine iteration does and
``Lockstep`` carries that plan to the other ranks; it knows nothing of ZeroMQ or of the wire format.

Facts this module is built on, measured with mlx 0.32.4 (CPU) and mlx-lm 0.32.2:

- a collective returns identical bytes on every rank, so value-driven choices (greedy tokens, stop
  tokens, accepted drafts) agree by themselves; only clock- and entropy-driven ones need a broadcast;
- a rank blocked in a ring collective busy-polls its socket (13.7 s of CPU in 20 s of waiting), so an
  idle leader keeps publishing at a slow tick (``Plan.wait_s``) and followers sleep between plans;
- collectives must be issued from one stream per rank, in one order on every rank: ``World`` puts
  its own on mlx-lm's generation stream, behind the model's look-ahead step (see ``_collective``);
- a ring collective whose peer is gone raises ``RuntimeError('[ring] connection to a peer was lost')``
  at once rather than hanging; ``PeerLost`` carries it so the caller can exit non-zero;
- mlx-lm's ``shard()`` divides head counts with ``//`` and never checks them: a llama with 3 heads
  over 2 ranks ran its forward without an error (each rank took one 48-wide "head"), one with 1 KV
  head failed in its first forward with a reshape error. ``plan_sharding`` refuses both first.

The parts: ``world`` (the group and its collectives), ``lockstep`` (broadcasts and plans) and
``sharding`` (splitting the model, fingerprints); this package exports them all.
"""

from __future__ import annotations

from workers.dist.lockstep import (
    Broadcaster,
    IDLE_WAIT_S,
    INLINE_BYTES,
    Lockstep,
    Plan,
)
from workers.dist.sharding import (
    available_modes,
    check_same,
    checkpoint_fingerprint,
    Mode,
    plan_sharding,
    prepare,
    shard,
    ShardReport,
    weight_fingerprint,
)
from workers.dist.world import (
    as_peer_lost,
    DistributedError,
    JOIN_TIMEOUT_S,
    launched_backend,
    launched_rank,
    launched_size,
    PeerLost,
    ShardError,
    World,
)

__all__ = [
    "Broadcaster",
    "DistributedError",
    "IDLE_WAIT_S",
    "INLINE_BYTES",
    "JOIN_TIMEOUT_S",
    "Lockstep",
    "Mode",
    "PeerLost",
    "Plan",
    "ShardError",
    "ShardReport",
    "World",
    "as_peer_lost",
    "available_modes",
    "check_same",
    "checkpoint_fingerprint",
    "launched_backend",
    "launched_rank",
    "launched_size",
    "plan_sharding",
    "prepare",
    "shard",
    "weight_fingerprint",
]
