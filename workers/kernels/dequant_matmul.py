"""Large batches through a transient bf16 weight: ``x @ dequantize(w).T``, one projection at a time.

At 128-256 rows a decode step is compute-bound, and MLX's dense matmul (cuBLAS's tensor-core GEMMs on
MLX CUDA) runs it several times faster than a quantized matmul. Dequantizing a projection's weight
just before its product adds one pass over its bf16 bytes and keeps nothing: resident memory stays
the 4-bit weights (vLLM's AWQ path does the same from 256 tokens). A weight whose bf16 copy would
exceed ``CHUNK_BYTES`` is dequantized and multiplied in slices of outputs, so the transient memory
stays bounded (a vocabulary head's bf16 copy is a gigabyte on an 8B model). The dequantization is
``dequant_kernel``'s on MLX CUDA (MLX's own dequantize runs far below the memory's speed there).

It is one more way the calibration times (``fastpath.DEQUANT``) from ``MIN_ROWS`` rows, so it runs only
at the shapes and row counts where it measured cheaper; the arithmetic is the dense shadow's
(``dense_shadow``): the weight rounded to the scales' dtype, then one matmul. ``MLX_BATCHD_DEQUANT=0``
takes it out of the plans; only the ``wide`` level routes by plans, so the exact levels never reach it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from workers import envs
from workers.kernels import dense_shadow, dequant_kernel

#: Row counts from which calibration times it (below, the weights' bf16 bytes cost more than the product).
MIN_ROWS = 32
#: The largest bf16 weight slice made at once.
CHUNK_BYTES = 128 << 20
#: Test seam: offer it on any backend (only MLX CUDA's plans are timed with it otherwise).
anywhere = False


def takes(m: nn.Module) -> bool:
    """Whether ``m`` can run this way here: a projection the dense shadow would copy (``dense_shadow.eligible``),
    on MLX CUDA (or anywhere with ``anywhere`` set), unless ``MLX_BATCHD_DEQUANT=0``."""
    if envs.switch(envs.DEQUANT) is False or not dense_shadow.eligible(m):
        return False
    return anywhere or (mx.default_device() == mx.gpu and mx.cuda.is_available())


def slices(n: int, k: int, itemsize: int = 2, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    """Output ranges ``[lo, hi)`` whose ``k``-wide weight rows of ``itemsize`` bytes fit ``chunk_bytes``
    (default ``CHUNK_BYTES``) each (at least one row a slice), as few and as even as that allows."""
    limit = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    parts = max(1, -(-(n * k * itemsize) // limit))
    parts = min(parts, n)
    bounds = [n * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def project(m: nn.Module, x: mx.array) -> mx.array | None:
    """``m(x)`` for flattened rows ``x`` [rows, K] through a transient dequantized weight (plus the
    bias), or ``None`` where ``takes`` refuses ``m``."""
    if x.ndim != 2 or not takes(m):
        return None
    assert isinstance(m, nn.QuantizedLinear) and m.biases is not None
    dtype = m.scales.dtype
    xs = x if x.dtype == dtype else x.astype(dtype)
    n = m.weight.shape[0]
    k = m.weight.shape[1] * 32 // m.bits
    parts = []
    for lo, hi in slices(n, k, dtype.size):
        w = dequant_kernel.dequantize(m.weight[lo:hi], m.scales[lo:hi], m.biases[lo:hi], m.group_size, m.bits)
        w = w if w.dtype == dtype else w.astype(dtype)
        parts.append(mx.addmm(m.bias[lo:hi], xs, w.T) if "bias" in m else xs @ w.T)
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
    return y if y.dtype == x.dtype else y.astype(x.dtype)
