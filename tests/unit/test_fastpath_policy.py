"""The fast path without a model: single-sequence contiguous K/V, and ``stock()`` lifting every
patch for the raw peer in benchmarks."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.helpers.fastpath import policy as policy
from workers import envs, kernels
from workers.kernels import fastpath


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


def test_the_compiled_layers_switch_overrides_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MLX_BATCHD_COMPILED_LAYERS`` overrides its field either way and keeps the rest of the policy;
    anything but 0 or 1 is refused by name (an operator's typo is an error, not a silent default)."""
    env = envs.COMPILED_LAYERS.name
    monkeypatch.setenv(envs.FASTPATH.name, "cuda")
    monkeypatch.setenv(env, "0")
    p = fastpath.detect()
    assert p.name == "cuda" and p.contiguous_kv and p.compiled_lone and not p.compiled_layers
    monkeypatch.setenv(envs.FASTPATH.name, "generic")
    monkeypatch.setenv(env, "1")
    assert fastpath.detect().compiled_layers
    monkeypatch.setenv(env, "on")
    with pytest.raises(ValueError, match=env):
        fastpath.detect()


def test_the_compiled_layers_are_on_in_the_cuda_policy_only() -> None:
    """And with them classic B = 1 decode, wherever they are on."""
    assert fastpath.CUDA.compiled_layers and not fastpath.GENERIC.compiled_layers
    assert fastpath.CUDA.compiled_lone
