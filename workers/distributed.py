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
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import msgpack
import numpy as np

#: How a model is split: mlx-lm's tensor parallel ``shard()``, its layer ``pipeline()``, or not at all.
Mode = Literal["tensor", "pipeline", "none"]

#: Bytes of the first collective of every broadcast; a payload that fits (a decode step's plan does)
#: costs one collective, a larger one (a batch of long prompts) a second one for the rest.
INLINE_BYTES = 1024
#: Seconds a rank waits for the others to join the group before it gives up (ranks start together).
JOIN_TIMEOUT_S = 120.0
#: Seconds an idle leader waits for commands before its next plan, and a follower sleeps after an idle
#: plan: a new request waits at most this long for the followers, who do not spin meanwhile.
IDLE_WAIT_S = 0.02

log = logging.getLogger("mlx_batchd.distributed")

_MAGIC = 0xB5
_HEADER = struct.Struct("<BxxxII")  # magic, payload length, broadcast ordinal


class DistributedError(RuntimeError):
    """A set-up that cannot serve, in one line that says what to change."""


class PeerLost(DistributedError):
    """A collective failed because another rank is gone: this rank must stop too, non-zero."""


class ShardError(DistributedError, ValueError):
    """A model that cannot be split over this world (family, head counts, or different weights)."""


# ----------------------------------------------------------------------------- the group


def _model_stream() -> Any:
    """The stream mlx-lm runs the model on (``generate_step``, ``BatchGenerator``): a per-thread one."""
    from mlx_lm.generate import generation_stream

    return generation_stream


def launched_backend(env: Mapping[str, str]) -> str | None:
    """The backend ``mlx.launch`` (or ``mpirun``) set this process up for, from its environment;
    ``None`` when it was started on its own.

    ``mlx.launch -n 1`` writes an empty ``MLX_HOSTFILE``, on which ``mx.distributed.init`` raises
    even with ``strict=False``; it counts as not launched."""
    if env.get("MLX_JACCL_COORDINATOR") or env.get("MLX_IBV_DEVICES"):
        return "jaccl"
    if env.get("NCCL_HOST_IP") and env.get("MLX_WORLD_SIZE"):
        return "nccl"
    hostfile = env.get("MLX_HOSTFILE")
    if hostfile and env.get("MLX_RANK") is not None:
        try:
            if os.path.getsize(hostfile) == 0:
                return None
        except OSError:
            pass  # let init name the missing file
        return "ring"
    if env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE"):
        return "mpi"
    return None


def launched_rank(env: Mapping[str, str]) -> int | None:
    """This process's rank as the launcher set it, read without joining the group (rank 0 of a
    daemon must not join it: its engine process does); ``None`` when not launched."""
    if launched_backend(env) is None:
        return None
    for key in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = env.get(key)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def launched_size(env: Mapping[str, str]) -> int | None:
    """How many ranks the launcher started, read without joining the group; ``None`` when not
    launched or not stated (the hostfile or variable is unreadable: joining then says why)."""
    backend = launched_backend(env)
    if backend is None:
        return None
    for key in ("MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = env.get(key)
        if value is not None and value.strip().isdigit():
            return int(value)
    listing = env.get("MLX_HOSTFILE") if backend == "ring" else env.get("MLX_IBV_DEVICES")
    if listing:
        try:
            hosts = json.loads(Path(listing).read_text())
        except (OSError, ValueError):
            return None
        return len(hosts) if isinstance(hosts, list) else None
    return None


def _join(backend: str, rank: str, timeout_s: float) -> Any:
    """``mx.distributed.init`` with a deadline.

    A ring rank waits for its peers without one, and ``init`` holds the GIL meanwhile, so no Python
    thread or handler can end the wait: where nothing else uses ``SIGALRM`` an alarm ends the
    process (its default action) once ``timeout_s`` passed, rather than a rank whose peer never
    started (having refused its set-up) waiting for good. The line before says what it waits for."""
    log.info("rank %s joining the %s group (the other ranks have %.0f s to join)", rank, backend, timeout_s)
    armed = signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None) and timeout_s > 0
    if armed:
        signal.alarm(max(1, math.ceil(timeout_s)))
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        raise DistributedError(
            f"cannot join the {backend} group as rank {rank}: {' '.join(str(exc).split())}"
        ) from None
    finally:
        if armed:
            signal.alarm(0)


@dataclass(frozen=True)
class World:
    """This process's place among the ranks serving one model."""

    rank: int
    size: int
    #: ``single`` when not launched, else the ``mx.distributed`` backend (ring, nccl, jaccl, mpi).
    backend: str
    group: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def single(cls) -> World:
        return cls(0, 1, "single", None)

    @classmethod
    def from_env(
        cls, backend: str | None = None, env: Mapping[str, str] | None = None, timeout_s: float = JOIN_TIMEOUT_S
    ) -> World:
        """Join the group ``mlx.launch`` set up (``backend`` overrides the detected one); ``single()``
        when this process was not launched as one of several. A ``DistributedError`` when the other
        ranks have not joined within ``timeout_s``."""
        env = os.environ if env is None else env
        backend = backend or launched_backend(env)
        if backend is None:
            return cls.single()
        group = _join(backend, env.get("MLX_RANK", "?"), timeout_s)
        if group.size() == 1:
            return cls.single()
        return cls(group.rank(), group.size(), backend, group)

    @property
    def leader(self) -> bool:
        """Rank 0: the one that owns the front end and decides every iteration."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def describe(self) -> dict[str, Any]:
        """For ``stats``: which rank answered, of how many, over what."""
        return {"rank": self.rank, "world_size": self.size, "backend": self.backend}

    def all_sum(self, x: mx.array) -> mx.array:
        """``mx.distributed.all_sum`` evaluated now; a lost peer raises ``PeerLost``."""
        return self._collective(mx.distributed.all_sum, x)

    def all_gather(self, x: mx.array) -> mx.array:
        """``mx.distributed.all_gather`` (rank order along axis 0) evaluated now."""
        return self._collective(mx.distributed.all_gather, x)

    def barrier(self) -> None:
        """Return once every rank got here (a one-element sum)."""
        if self.distributed:
            self.all_sum(mx.array([1], dtype=mx.int32))

    def _collective(self, op: Callable[..., mx.array], x: mx.array) -> mx.array:
        """Run ``op`` on the model's stream, behind any forward still in flight there.

        mlx-lm evaluates the next decode step ahead (``async_eval`` on its per-thread generation
        stream), and a sharded forward holds collectives. A collective issued meanwhile on another
        stream runs on another thread over the same ring sockets: the two interleave, and a follower
        received zeros or activation bytes in place of the plan (seen in most runs under
        ``mlx.launch`` after ``generate_step`` returned with its look-ahead step still running)."""
        if not self.distributed:
            return x
        try:
            with mx.stream(_model_stream()):
                out = op(x, group=self.group)
            mx.eval(out)
        except RuntimeError as exc:
            raise PeerLost(f"rank {self.rank}: the {self.backend} group broke ({' '.join(str(exc).split())})") from None
        return out


#: How mlx's backends word a collective whose peer went away, as raised from inside a forward.
_LOST_WORDS = ("connection to a peer was lost", "[ring]", "[nccl]", "[jaccl]", "[mpi]")


def as_peer_lost(world: World, exc: BaseException) -> PeerLost | None:
    """``exc`` as a ``PeerLost`` when it is a collective that failed inside a sharded forward (mlx
    raises a ``RuntimeError`` naming its backend), else ``None``."""
    if isinstance(exc, PeerLost):
        return exc
    text = " ".join(str(exc).split())
    if not world.distributed or not isinstance(exc, RuntimeError) or not any(w in text for w in _LOST_WORDS):
        return None
    return PeerLost(f"rank {world.rank}: the {world.backend} group broke ({text})")


# ----------------------------------------------------------------------------- broadcast


def _to_array(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def _to_bytes(x: mx.array) -> bytes:
    return np.asarray(x).tobytes()


class Broadcaster:
    """Rank 0's msgpack-able value on every rank, as sums of ``uint8`` arrays to which the other
    ranks add zeros (mlx has no broadcast; nothing is pickled, so a peer cannot run code here).

    Every broadcast carries an ordinal: a follower that receives one out of turn, or a sum two ranks
    both wrote into, fails loudly instead of applying garbage."""

    def __init__(self, world: World, inline_bytes: int = INLINE_BYTES) -> None:
        if inline_bytes <= _HEADER.size:
            raise ValueError(f"inline_bytes must exceed the {_HEADER.size}-byte header")
        self.world = world
        self.inline_bytes = inline_bytes
        self.count = 0

    def __call__(self, value: Any = None) -> Any:
        """Rank 0 passes ``value`` and gets it back; the others pass nothing and get rank 0's."""
        ordinal, self.count = self.count, self.count + 1
        if not self.world.distributed:
            return value
        room = self.inline_bytes - _HEADER.size
        if self.world.leader:
            payload = msgpack.packb(value, use_bin_type=True)
            first = bytearray(self.inline_bytes)
            _HEADER.pack_into(first, 0, _MAGIC, len(payload), ordinal)
            first[_HEADER.size : _HEADER.size + min(room, len(payload))] = payload[:room]
            self.world.all_sum(_to_array(bytes(first)))
            if len(payload) > room:
                self.world.all_sum(_to_array(payload[room:]))
            return value
        first_bytes = _to_bytes(self.world.all_sum(mx.zeros((self.inline_bytes,), dtype=mx.uint8)))
        magic, length, got = _HEADER.unpack_from(first_bytes, 0)
        if magic != _MAGIC or got != ordinal:
            raise DistributedError(
                f"rank {self.world.rank}: broadcast {ordinal} arrived as {got} (marker {magic:#x}); the ranks diverged"
            )
        payload = first_bytes[_HEADER.size : _HEADER.size + min(room, length)]
        if length > room:
            payload += _to_bytes(self.world.all_sum(mx.zeros((length - room,), dtype=mx.uint8)))
        try:
            return msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except ValueError as exc:  # msgpack's format errors are ValueErrors
            raise DistributedError(
                f"rank {self.world.rank}: broadcast {ordinal} is not msgpack ({exc}); the ranks diverged"
            ) from None


# ----------------------------------------------------------------------------- sharding


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def available_modes(model: Any) -> tuple[Mode, ...]:
    """What mlx-lm offers for this model: ``shard()`` on the model (tensor parallel) and/or
    ``pipeline()`` on its inner model, the same tests ``mlx_lm.utils.sharded_load`` makes."""
    modes: list[Mode] = []
    if callable(getattr(model, "shard", None)):
        modes.append("tensor")
    if callable(getattr(getattr(model, "model", None), "pipeline", None)):
        modes.append("pipeline")
    return tuple(modes)


def _heads_problem(config: Mapping[str, Any], size: int) -> str | None:
    text = _text_config(config)
    heads = text.get("num_attention_heads")
    kv = text.get("num_key_value_heads", heads)
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if isinstance(n, int) and n % size:
            return f"{name}={n} is not divisible by the world size {size}"
    return None


def _layers_problem(config: Mapping[str, Any], size: int) -> str | None:
    layers = _text_config(config).get("num_hidden_layers")
    if isinstance(layers, int) and layers < size:
        return f"{layers} layers cannot give each of {size} ranks one"
    return None


def plan_sharding(model: Any, config: Mapping[str, Any], size: int, mode: Mode | Literal["auto"] = "auto") -> Mode:
    """The mode to split ``model`` over ``size`` ranks, or a ``ShardError`` in one line.

    ``auto`` takes tensor parallel when mlx-lm has it for the family and the heads divide, else the
    pipeline when mlx-lm has that, else refuses naming the family and why."""
    if size == 1:
        return "none"
    family = str(config.get("model_type", type(model).__module__.rsplit(".", 1)[-1]))
    import mlx_lm

    have = available_modes(model)
    where = f"model_type {family!r} over {size} ranks (mlx-lm {mlx_lm.__version__})"
    if not have:
        raise ShardError(f"cannot shard {where}: mlx-lm has neither a tensor-parallel shard() nor a pipeline()")
    if mode not in ("auto", "tensor", "pipeline"):
        raise ShardError(f"cannot shard {where}: unknown mode {mode!r} (auto, tensor or pipeline)")
    tensor_why = (
        "mlx-lm has no tensor-parallel shard() for it" if "tensor" not in have else _heads_problem(config, size)
    )
    pipeline_why = "mlx-lm has no pipeline() for it" if "pipeline" not in have else _layers_problem(config, size)
    if mode in ("auto", "tensor") and tensor_why is None:
        return "tensor"
    if mode in ("auto", "pipeline") and pipeline_why is None:
        return "pipeline"
    why = {"tensor": tensor_why, "pipeline": pipeline_why}
    if mode == "auto":
        raise ShardError(f"cannot shard {where}: tensor parallel: {tensor_why}; pipeline: {pipeline_why}")
    raise ShardError(f"cannot shard {where} by {mode}: {why[mode]}")


def shard(model: Any, world: World, config: Mapping[str, Any], mode: Mode | Literal["auto"] = "auto") -> Mode:
    """Split ``model`` in place for this rank and return the mode used (``none`` for one rank).

    Call it before the weights are evaluated when they were loaded lazily (``mlx_lm.load(...,
    lazy=True)``): each rank then reads only its own part. Ends with a barrier, so a slow loader does
    not leave the others waiting inside their first forward."""
    chosen = plan_sharding(model, config, world.size, mode)
    if chosen == "none":
        return chosen
    try:
        if chosen == "tensor":
            model.shard(world.group)
        else:
            model.model.pipeline(world.group)
        mx.eval(model.parameters())
    except (ValueError, RuntimeError) as exc:
        family = config.get("model_type", "?")
        raise ShardError(
            f"cannot shard model_type {family!r} over {world.size} ranks by {chosen}: {' '.join(str(exc).split())}"
        ) from None
    world.barrier()
    return chosen


# ----------------------------------------------------------------------------- same weights everywhere


def _flat_items(tree: Any, prefix: str = "") -> Iterable[tuple[str, mx.array]]:
    if isinstance(tree, mx.array):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k in sorted(tree):
            yield from _flat_items(tree[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flat_items(v, f"{prefix}.{i}")


def weight_fingerprint(model: Any, samples: int = 512) -> bytes:
    """16 bytes that differ when two ranks hold different weights: every parameter's name, shape and
    dtype, and ``samples`` evenly spaced values of it (their bytes, so no arithmetic can blur them).

    Call it before ``shard`` (each rank's shard differs by design). It reads every parameter, so on
    lazily loaded weights it loads them all; for a checkpoint on disk ``checkpoint_fingerprint`` does
    not."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in _flat_items(model.parameters()):
        h.update(f"{name}:{p.shape}:{p.dtype};".encode())
        flat = p.reshape(-1)
        if flat.size > samples:
            stride = flat.size // samples
            flat = flat[: stride * samples : stride]
        h.update(_to_bytes(mx.contiguous(flat).view(mx.uint8)))
    return h.digest()


def checkpoint_fingerprint(path: Path | str, samples: int = 16, span: int = 4096) -> bytes:
    """16 bytes that differ when two ranks point at different checkpoints, read from the files
    without loading them: ``config.json``, every safetensors file's size and header, and ``samples``
    evenly spaced ``span``-byte windows of its data."""
    root = Path(path)
    h = hashlib.blake2b(digest_size=16)
    config = json.loads((root / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True).encode())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size};".encode())
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(n))
            start = 8 + n
            body = max(size - start, 0)
            for i in range(samples):
                fh.seek(start + (body * i) // samples)
                h.update(fh.read(span))
    return h.digest()


def check_same(
    world: World, digest: bytes, what: str = "weights", fix: str = "point every rank at the same model"
) -> None:
    """Every rank's ``digest`` against rank 0's; every rank raises the same one-line ``ShardError``
    naming the ranks that differ (and ``fix``), so all of them stop before the first forward."""
    if not world.distributed:
        return
    gathered = _to_bytes(world.all_gather(_to_array(digest)))
    width = len(digest)
    parts = [gathered[i * width : (i + 1) * width] for i in range(world.size)]
    bad = [r for r, d in enumerate(parts) if d != parts[0]]
    if bad:
        detail = ", ".join(f"rank {r} has {parts[r].hex()[:12]}" for r in bad)
        raise ShardError(f"the ranks loaded different {what}: rank 0 has {parts[0].hex()[:12]}, {detail}; {fix}")


@dataclass(frozen=True)
class ShardReport:
    """What ``prepare`` did, for the log line at start and for ``stats``."""

    mode: Mode
    rank: int
    world_size: int
    backend: str
    model_type: str
    fingerprint: str


def prepare(
    model: Any,
    world: World,
    config: Mapping[str, Any],
    digest: bytes | None = None,
    mode: Mode | Literal["auto"] = "auto",
) -> ShardReport:
    """Check that every rank holds the same weights, then shard: the start-up of a sharded engine.

    ``digest`` is ``checkpoint_fingerprint`` of the model directory, or ``None`` to take
    ``weight_fingerprint`` of the (unsharded) model."""
    plan_sharding(model, config, world.size, mode)  # a bad family or head count fails before any read
    digest = weight_fingerprint(model) if digest is None else digest
    check_same(world, digest)
    chosen = shard(model, world, config, mode)
    return ShardReport(chosen, world.rank, world.size, world.backend, str(config.get("model_type")), digest.hex())


# ----------------------------------------------------------------------------- lockstep


@dataclass
class Plan:
    """One engine iteration as rank 0 decided it; every rank applies it in the same order.

    ``commands`` are the front end's commands taken this iteration (submits, cancels, pauses,
    resumes), already in wire form and applied in order before anything else. ``decisions`` are the
    iteration's clock- or entropy-driven choices, by name (whether it is a burst round, a batched
    step or a probe step, a seed drawn for an unseeded request). ``wait_s`` is how long rank 0 will
    wait for commands before its next plan: followers sleep that long instead of spinning inside
    the next collective. ``stop`` ends the followers' loop."""

    iteration: int
    commands: list[Any] = field(default_factory=list)
    decisions: dict[str, Any] = field(default_factory=dict)
    wait_s: float = 0.0
    stop: bool = False

    def to_wire(self) -> list[Any]:
        return [self.iteration, self.commands, self.decisions, self.wait_s, self.stop]

    @classmethod
    def from_wire(cls, w: list[Any]) -> Plan:
        iteration, commands, decisions, wait_s, stop = w
        return cls(iteration, commands, decisions, wait_s, stop)


class Lockstep:
    """Rank 0 publishes each iteration's ``Plan``; followers receive them in order.

    On one rank ``publish`` costs nothing and ``receive`` is never called, so the engine loop can
    use it unconditionally."""

    def __init__(self, world: World, inline_bytes: int = INLINE_BYTES) -> None:
        self.world = world
        self._broadcast = Broadcaster(world, inline_bytes)
        self.iteration = 0
        self._sleep_s = 0.0

    def publish(
        self,
        commands: list[Any] | None = None,
        decisions: dict[str, Any] | None = None,
        wait_s: float = 0.0,
        stop: bool = False,
    ) -> Plan:
        """Rank 0: send this iteration's plan to every follower and return it."""
        if not self.world.leader:
            raise DistributedError(f"rank {self.world.rank} may not publish plans: only rank 0 decides")
        plan = Plan(self.iteration, commands or [], decisions or {}, wait_s, stop)
        self._broadcast(plan.to_wire())
        self.iteration += 1
        return plan

    def receive(self) -> Plan:
        """A follower: the next plan (after sleeping the last plan's ``wait_s``)."""
        if self.world.leader:
            raise DistributedError("rank 0 publishes plans; it never receives them")
        if self._sleep_s > 0:
            time.sleep(self._sleep_s)
        plan = Plan.from_wire(self._broadcast())
        if plan.iteration != self.iteration:
            raise DistributedError(
                f"rank {self.world.rank}: plan {plan.iteration} arrived where {self.iteration} was due"
            )
        self.iteration += 1
        self._sleep_s = plan.wait_s
        return plan

    def follow(self, apply: Callable[[Plan], None]) -> int:
        """A follower's whole loop: apply every plan until rank 0 says stop; returns the plans applied."""
        applied = 0
        while True:
            plan = self.receive()
            if plan.stop:
                return applied
            apply(plan)
            applied += 1
