"""Pieces of the demo training script that decide what the drafters learn (no training run here)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

from workers.demo import train


def _target() -> tuple[llama.Model, dict]:
    shape = dict(hidden_size=32, num_hidden_layers=3, intermediate_size=64, num_attention_heads=2)
    mx.random.seed(3)
    target = llama.Model(train.llama_args(64, shape))
    target.set_dtype(mx.bfloat16)
    mx.eval(target.parameters())
    return target, shape


def test_draft_from_target_is_the_targets_early_exit() -> None:
    target, shape = _target()
    draft, draft_shape = train.draft_from_target(target, shape, layers=2)
    assert draft_shape["num_hidden_layers"] == 2 and len(draft.model.layers) == 2
    tokens = mx.array([[1, 5, 9, 2, 7]])
    # The target's embedding, first two blocks and final norm, then its tied output head, in float32.
    target.set_dtype(mx.float32)
    h = target.model.embed_tokens(tokens)
    mask = nn.MultiHeadAttention.create_additive_causal_mask(tokens.shape[1]).astype(h.dtype)
    for layer in target.model.layers[:2]:
        h = layer(h, mask)
    expected = target.model.embed_tokens.as_linear(target.model.norm(h))
    got = draft(tokens)
    assert got.dtype == mx.float32
    assert mx.allclose(got, expected, atol=1e-5).item()
    # more layers than the target has: the whole target
    _, whole = train.draft_from_target(target, shape, layers=9)
    assert whole["num_hidden_layers"] == 3


def test_mixed_batches_take_the_pool_share() -> None:
    tokens = np.arange(10_000, dtype=np.uint16) % 50 + 100  # real windows: ids 100..149
    pool = np.full((20, 9), 7, dtype=np.uint16)  # pool rows: all 7
    batch = next(train.mixed_batches(tokens, pool, 8, np.random.default_rng(0), pool_share=0.75))
    rows = np.array(batch)
    assert rows.shape == (8, 9)
    assert int((rows == 7).all(axis=1).sum()) == 6
    only_real = next(train.mixed_batches(tokens, pool, 8, np.random.default_rng(0), pool_share=0.0))
    assert not (np.array(only_real) == 7).any()
