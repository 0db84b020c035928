"""The masked one-query attention kernel (``workers.kernels.batch_attention``) on the GPU: each sequence's
output against a float32 reference over only its unmasked keys, on the 8B's and SmolLM2's heads, over the
strided views a batch cache returns, at short and long key counts; and its first-call check keeps it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from workers.kernels import batch_attention

pytestmark = pytest.mark.gpu


def _reference(q: mx.array, k: mx.array, v: mx.array, starts: list[int], scale: float) -> np.ndarray:
    qf, kf, vf = (np.array(a.astype(mx.float32)) for a in (q, k, v))
    heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    out = np.zeros(q.shape, dtype=np.float64)
    for b, start in enumerate(starts):
        for h in range(heads):
            keys, values = kf[b, h // groups, start:], vf[b, h // groups, start:]
            s = keys.astype(np.float64) @ qf[b, h, 0].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[b, h, 0] = (p / p.sum()) @ values
    return out


@pytest.mark.parametrize("b,length", [(2, 9), (8, 200), (64, 130), (4, 1500)])
@pytest.mark.parametrize("heads,kv,dim", [(32, 8, 128), (9, 3, 64)])
def test_each_sequence_attends_over_its_own_keys_within_bf16(
    b: int, length: int, heads: int, kv: int, dim: int
) -> None:
    rng = np.random.default_rng(b * length + heads)
    starts = [int(s) for s in rng.integers(0, length - 1, size=b)]
    starts[0] = 0
    q = (mx.random.normal((b, heads, 1, dim), key=mx.random.key(1)) * 0.5).astype(mx.bfloat16)
    k_buf = mx.random.normal((b, kv, length + 64, dim), key=mx.random.key(2)).astype(mx.bfloat16)
    v_buf = mx.random.normal((b, kv, length + 64, dim), key=mx.random.key(3)).astype(mx.bfloat16)
    k, v = k_buf[:, :, :length], v_buf[:, :, :length]  # a batch cache's views of its buffer
    mask = mx.arange(length)[None, None, None, :] >= mx.array(starts)[:, None, None, None]
    scale = dim**-0.5
    got = np.array(batch_attention.launch(q, k, v, mask, scale).astype(mx.float32))
    ref = _reference(q, k, v, starts, scale)
    mlx = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask).astype(mx.float32))
    err, mlx_err = np.abs(got - ref).max(), np.abs(mlx - ref).max()
    print(f"B {b} keys {length} heads {heads}/{kv}: max error {err:.3g}, MLX's masked call {mlx_err:.3g}")
    assert err <= max(2.0**-7 * np.abs(np.array(v.astype(mx.float32))).max(), 1.25 * mlx_err)


def test_its_first_call_check_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_BATCHD_BATCH_ATTENTION", "1")
    monkeypatch.setattr(batch_attention, "_checked", {})
    q = mx.random.normal((16, 32, 1, 128), key=mx.random.key(4)).astype(mx.bfloat16)
    k = mx.random.normal((16, 8, 77, 128), key=mx.random.key(5)).astype(mx.bfloat16)
    mask = mx.arange(77)[None, None, None, :] >= (mx.arange(16) * 3)[:, None, None, None]
    assert batch_attention.takes(q, k, k, mask, {})
    batch_attention.attend(q, k, k, mask, 0.088)
    assert batch_attention._checked == {(32, 8, 128, mx.bfloat16): True}
