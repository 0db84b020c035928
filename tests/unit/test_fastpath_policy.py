"""The fast path without a model: single-sequence contiguous K/V, and ``stock()`` lifting every
patch for the raw peer in benchmarks."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from tests.helpers.fastpath import policy as policy
from workers import fastpath, kernels


def test_contiguous_kv_only_for_a_single_sequence(policy: None) -> None:
    fastpath.set_active(fastpath.CUDA)
    buf = mx.random.normal((2, 2, 16, 4))
    k, v = buf[:, :, :5], buf[:, :, :5]
    assert fastpath.attention_inputs(k, v)[0] is k  # batched: the cache's own views
    one = buf[:1, :, :5]
    ck, _ = fastpath.attention_inputs(one, one)
    assert ck is not one and bool(mx.all(ck == one).item())
    fastpath.set_active(fastpath.GENERIC)
    assert fastpath.attention_inputs(one, one)[0] is one


def test_stock_lifts_the_patches_and_puts_them_back() -> None:
    kernels.install()
    patched = nn.Linear.__call__
    assert hasattr(patched, "__wrapped__")
    with kernels.stock():
        assert not hasattr(nn.Linear.__call__, "__wrapped__")
    assert nn.Linear.__call__ is not patched or hasattr(nn.Linear.__call__, "__wrapped__")
    assert hasattr(nn.Linear.__call__, "__wrapped__")
