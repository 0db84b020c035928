"""Splitting one model over the ranks, and checking first that every rank holds the same one.

``plan_sharding`` refuses a family or head count mlx-lm's ``shard()`` would split wrongly;
``weight_fingerprint``/``checkpoint_fingerprint`` and ``check_same`` stop every rank when their
weights (or options) differ; ``prepare`` is the whole start-up of a sharded engine.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

from workers.dist.world import ShardError, World, array_bytes, uint8_array

#: How a model is split: mlx-lm's tensor parallel ``shard()``, its layer ``pipeline()``, or not at all.
Mode = Literal["tensor", "pipeline", "none"]


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
        h.update(array_bytes(mx.contiguous(flat).view(mx.uint8)))
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
    gathered = array_bytes(world.all_gather(uint8_array(digest)))
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
