"""The ``mirrored`` rung on dense (bf16) layers: ``gemv_rows`` repeats MLX CUDA's one-row ``gemv`` on
several rows at once.

The CUDA kernel cannot run on this CPU, so its launch is replaced by a stand-in (named as such): one
that returns MLX's own one-row results is taken after one check per weight shape; one a single
rounding step off is refused for good and decode's own one-row calls are made instead.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from workers import kernels
from workers.api import Level
from workers.kernels import bytes_equal, gemv_rows, scoped
from workers.models.synthetic import llama_config, write_model


@pytest.fixture
def cuda_stand_in(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The switch at ``cuda``, fresh checks, and a stand-in launch that records its rows and returns
    MLX's own one-row call per row."""
    monkeypatch.setattr(gemv_rows.rowkernel, "implementation", lambda: "cuda")
    monkeypatch.setattr(gemv_rows, "_matches_mlx", {})
    monkeypatch.setattr(gemv_rows, "_compiled", None)
    launches: list[int] = []

    def one_row_stand_in(x: mx.array, w: mx.array) -> mx.array:
        launches.append(int(x.shape[0]))
        return mx.concatenate([x[i : i + 1] @ w.T for i in range(x.shape[0])])

    monkeypatch.setattr(gemv_rows, "_launch", one_row_stand_in)
    return launches


def _original(module: nn.Module) -> object:
    call = type(module).__call__
    return getattr(call, "__wrapped__", call)


def test_the_kernel_takes_dense_layers_without_a_bias_and_tied_heads_of_the_rows_dtype() -> None:
    x = mx.zeros((3, 64), dtype=mx.bfloat16)
    plain = nn.Linear(64, 32, bias=False)
    plain.set_dtype(mx.bfloat16)
    biased = nn.Linear(64, 32)
    biased.set_dtype(mx.bfloat16)
    head = nn.Embedding(100, 64)
    head.set_dtype(mx.bfloat16)
    quantized = nn.QuantizedLinear(64, 32, bits=4, group_size=32)
    assert gemv_rows.covered(plain, x) is plain.weight
    assert gemv_rows.covered(head, x) is head.weight
    assert gemv_rows.covered(biased, x) is None  # MLX runs it through cuBLAS with the bias fused
    assert gemv_rows.covered(quantized, x) is None  # qmv_rows' part
    assert gemv_rows.covered(plain, x.astype(mx.float16)) is None  # weights of another dtype
    assert gemv_rows.covered(plain, mx.zeros((3, 65), dtype=mx.bfloat16)) is None
    assert [gemv_rows.per_lane(k) for k in (256, 704, 100)] == [4, 2, 1]  # MLX's n_per_thread


def test_a_stand_in_equal_to_mlx_is_used_and_one_that_differs_falls_back(
    cuda_stand_in: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    mx.random.seed(3)
    layer = nn.Linear(256, 24, bias=False)
    layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((11, 256), key=mx.random.key(2)).astype(mx.bfloat16)
    original = _original(layer)
    out = gemv_rows.project(layer, original, x)
    assert out is not None and bytes_equal(out, mx.concatenate([layer(x[i : i + 1]) for i in range(11)]))
    checks = len(cuda_stand_in)
    assert gemv_rows.project(layer, original, x) is not None
    assert cuda_stand_in[checks:] == [8, 3]  # 11 rows: calls of 8 and 3; the check is not repeated
    assert list(gemv_rows.report().values()) == [True]

    equal = gemv_rows._launch

    def off_by_one_step(x: mx.array, w: mx.array) -> mx.array:
        return (equal(x, w).view(mx.uint16) ^ mx.array(1, dtype=mx.uint16)).view(mx.bfloat16)

    other = nn.Linear(256, 40, bias=False)
    other.set_dtype(mx.bfloat16)
    monkeypatch.setattr(gemv_rows, "_launch", off_by_one_step)
    assert gemv_rows.project(other, original, x) is None
    assert sorted(gemv_rows.report().values()) == [False, True]


def test_a_dense_models_mirrored_block_goes_through_the_kernel_with_decodes_bytes(
    cuda_stand_in: list[int], tmp_path: Path
) -> None:
    """A bf16 llama with tied embeddings (the demo pair's kind): a 5-token block at ``mirrored`` runs
    every projection and the tied head through the (stand-in) kernel, one call each, and its logits
    are the bytes the same block gives with decode's one-row call per row."""
    path = write_model(tmp_path / "dense", {**llama_config(hidden=128, layers=2, ffn=256), "tie_word_embeddings": True})
    model = load(str(path))[0]
    kernels.install()
    prompt = mx.array([[5, 9, 11, 13]])
    block = mx.array([[20, 21, 22, 23, 24]])

    def verify() -> mx.array:
        cache = make_prompt_cache(model)
        mx.eval(model(prompt, cache=cache))
        with scoped(Level.MIRRORED):
            return model(block, cache=kernels.wrap_caches(cache))

    mx.eval(verify())  # each weight shape checked once, at its first use
    assert len(gemv_rows.report()) == 5 and all(gemv_rows.report().values())
    cuda_stand_in.clear()
    through = verify()
    mx.eval(through)
    assert cuda_stand_in == [5] * (2 * 7 + 1)  # q, k, v, o, gate, up, down a layer, and the tied head
    gemv_rows._compiled = False  # the kernel unavailable: decode's one-row calls
    assert bytes_equal(through, verify())
