"""The project's dequantize kernel on the GPU: bit for bit ``mx.dequantize`` on every projection shape of
the 8B and of SmolLM2 at groups 32, 64 and 128, with bf16 and float16 scales (the launch itself, not the wrapper that falls back to MLX
where its first call differs), and large-batch products through it (``dequant_matmul``) byte for byte MLX's
dense product of ``mx.dequantize``'s weight, with the kernel kept (its first-call check passed)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from workers.kernels import dequant_kernel, dequant_matmul

pytestmark = pytest.mark.gpu

SHAPES = [
    (4096, 4096),
    (1024, 4096),
    (14336, 4096),
    (4096, 14336),
    (128256, 4096),
    (576, 576),
    (192, 576),
    (1536, 576),
    (576, 1536),
]


def _same_bits(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a.view(mx.uint16), b.view(mx.uint16)))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_kernel_gives_mlx_s_dequantize_bit_for_bit(n: int, k: int, gs: int, dtype: mx.Dtype) -> None:
    """bf16 scales, and float16 ones (a GGUF model's on a GPU)."""
    if k % gs:
        pytest.skip("K not a multiple of the group")
    w = mx.random.normal((n, k), key=mx.random.key(n + k + gs)).astype(dtype) * 0.02
    q, s, b = mx.quantize(w, group_size=gs, bits=4)
    assert dequant_kernel.takes(q, s, 4, gs)
    got = dequant_kernel.launch(q, s, b, gs)  # the kernel itself, not its checked wrapper
    assert _same_bits(got, mx.dequantize(q, s, b, group_size=gs, bits=4))


@pytest.mark.parametrize("rows", [32, 256])
def test_a_large_batch_through_it_is_mlx_s_dense_product_byte_for_byte(rows: int) -> None:
    m = nn.QuantizedLinear(4096, 14336, bias=False, group_size=64, bits=4)
    m.set_dtype(mx.bfloat16)
    x = (mx.random.normal((rows, 4096), key=mx.random.key(rows)) * 0.5).astype(mx.bfloat16)
    assert m.biases is not None and dequant_matmul.takes(m)
    want = x @ mx.dequantize(m.weight, m.scales, m.biases, group_size=64, bits=4).T
    got = dequant_matmul.project(m, x)
    assert got is not None and _same_bits(got, want)
    assert dequant_kernel._checked[(14336, 512, 64, mx.bfloat16)] is True
