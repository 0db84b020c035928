"""The physical reference: the decode rate the memory bandwidth allows when every weight byte and
each sequence's KV are read once per step."""

from __future__ import annotations


def reference_tok_s(weight_bytes: int, kv_bytes_per_token: int, context: int, batch: int, gb_per_s: float) -> float:
    """The physical limit of a decode step: every weight byte and each sequence's KV read once per
    step at the memory bandwidth; ``batch`` tokens come out of each step."""
    step_bytes = weight_bytes + batch * kv_bytes_per_token * context
    return batch * gb_per_s * 1e9 / step_bytes


def reference_line(weight_bytes: int, kv_bytes_per_token: int, context: int, batch: int, gb_per_s: float) -> str:
    """The physical reference in words: what one decode step reads and the rate that allows."""
    kv = batch * kv_bytes_per_token * context
    each = "" if batch == 1 else f" for each of {batch} sequences"
    return (
        f"physical limit at B = {batch}: {weight_bytes / 1e9:.3f} GB of weights + {kv / 1e6:.3f} MB of KV "
        f"({context} tokens of context{each}) read per step at {gb_per_s:g} GB/s = "
        f"{reference_tok_s(weight_bytes, kv_bytes_per_token, context, batch, gb_per_s):.1f} tok/s"
    )
