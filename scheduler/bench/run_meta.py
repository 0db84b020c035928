"""What a matrix run records about itself beside its samples: the model, the device and MLX, the
workload and every setting the arms ran with, so that two runs' tables can be told apart."""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.bench.batched import Setup
from scheduler.bench.env_arms import EnvArm


def run_meta(
    args: argparse.Namespace,
    setup: Setup,
    machine: dict[str, Any],
    env_arms: list[EnvArm],
    daemon_args: list[str],
    drafters: list[str],
    prompt_tokens: int,
) -> dict[str, Any]:
    """``machine``: what the bench process read of the model and the device (path, device, MLX's
    version, kernels, memory and bandwidth figures)."""
    return {
        "raw_max_batch": setup.raw_max_batch,
        "model": args.model,
        "tokens": args.tokens,
        "prompt_tokens": prompt_tokens,
        "prompts": args.prompts,
        "repeats": args.repeats,
        "min_seconds": args.min_seconds,
        "context": setup.context,
        "drafters": drafters,
        "process_pin": args.process_pin,
        "env_arms": {a.name: a.env for a in env_arms},
        "daemon_args": daemon_args,
        "weight_bytes": setup.weight_bytes,
        "kv_bytes_per_token": setup.kv_bytes_per_token,
        "bandwidth_gb_s": setup.gb_per_s,
        **machine,
    }
