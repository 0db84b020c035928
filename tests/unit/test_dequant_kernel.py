"""The dequantize kernel's per-thread index math (``workers.kernels.dequant_kernel``), checked on the CPU.

A numpy replay of what each thread does (its 16 bytes of packed words, its group's scale and bias, ``dq2``
on ``w >> 0/4/8/12``, the four ``__byte_perm`` pairs and the 64 bytes it stores) must give MLX CUDA's
dequantize bit for bit (``scale * q + bias`` as one bf16 FMA) on every projection shape at groups 32, 64
and 128. The kernel itself runs on the device (``tests/gpu/test_dequant_gpu.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.helpers.packed import random_packed
from workers.kernels import dequant_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import w4a16_marlin_emulate as emu  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (4096, 14336), (576, 576), (192, 576), (1536, 576), (576, 1536)]


def _bits(v: np.ndarray) -> np.ndarray:
    """bf16 values held as float32 -> their 16 bits."""
    return (v.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint32)


def _byte_perm(x: np.ndarray, y: np.ndarray, sel: int) -> np.ndarray:
    """CUDA's ``__byte_perm(x, y, sel)``: byte i of the result is byte ``(sel >> 4 i) & 7`` of (y:x)."""
    both = (y.astype(np.uint64) << np.uint64(32)) | x.astype(np.uint64)
    out = np.zeros_like(x, dtype=np.uint32)
    for i in range(4):
        src = (sel >> (4 * i)) & 7
        out |= (((both >> np.uint64(8 * src)) & np.uint64(0xFF)).astype(np.uint32)) << np.uint32(8 * i)
    return out


def _pairs(word: np.ndarray, s: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One word's 16 output bytes as four uint32 (``dq2`` on ``w >> 0/4/8/12``, then the four pairs)."""
    r = []
    for shift in (0, 4, 8, 12):
        lo, hi = emu._dq2(word >> np.uint32(shift), s, b)
        r.append(_bits(lo) | (_bits(hi) << np.uint32(16)))
    return np.stack(
        [
            _byte_perm(r[0], r[1], 0x5410),
            _byte_perm(r[2], r[3], 0x5410),
            _byte_perm(r[0], r[1], 0x7632),
            _byte_perm(r[2], r[3], 0x7632),
        ],
        axis=1,
    )


def emulate(q: np.ndarray, scales: np.ndarray, biases: np.ndarray, gs: int) -> np.ndarray:
    """The kernel's output (bf16 bits, [N, K]) as its threads compute it: thread t's i-th word is
    ``(t >> 5) * 128 + (t & 31) + 32 i``, its 16 bytes at that word's place."""
    n, kw = q.shape
    g = kw * 8 // gs
    t = np.arange(n * kw // 4)
    out = np.full((n * kw, 4), 0xFFFFFFFF, dtype=np.uint32)
    flat = q.reshape(-1)
    for i in range(4):
        wi = (t >> 5) * 128 + (t & 31) + i * 32
        row, c = wi // kw, wi % kw
        gi = row * g + (c * 8) // gs
        s = scales.reshape(-1)[gi].astype(np.float32)
        b = biases.reshape(-1)[gi].astype(np.float32)
        out[wi] = _pairs(flat[wi], s, b)
    return out.reshape(-1).view(np.uint16).reshape(n, kw * 8)


@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("n,k", SHAPES)
def test_emulated_kernel_is_mlx_cuda_dequantize_bit_for_bit(n: int, k: int, gs: int) -> None:
    if k % gs:
        pytest.skip("K not a multiple of the group")
    q, s, b = random_packed(n, k, gs, seed=n + k + gs)
    got = emulate(np.array(q), np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32)), gs)
    want = _bits(emu.cuda_dequantize(q, s, b, gs)).astype(np.uint16)
    assert np.array_equal(got, want)


def test_the_source_holds_the_emulated_index_math() -> None:
    text = dequant_kernel.HEADER + dequant_kernel.SOURCE
    for expr in (
        "w4m::dq2t<T>(w >> 4, s2, b2)",
        "w4m::dq2t<T>(w >> 8, s2, b2)",
        "w4m::dq2t<T>(w >> 12, s2, b2)",
        "return dq2(w, s2, b2);",
        "__byte_perm(r0, r1, 0x5410), __byte_perm(r2, r3, 0x5410), __byte_perm(r0, r1, 0x7632),",
        "__byte_perm(r2, r3, 0x7632)",
        "v | (v << 16)",
        "const long long base = (t >> 5) * 128 + (t & 31);",
        "const long long wi = base + i * 32;",
        "(size_t)row * G + (size_t)(c * 8 / GS)",
        "reinterpret_cast<uint4*>(out)[wi] = w4d::word8<T>(w[wi]",
    ):
        assert expr in text, expr


def test_it_is_mlx_s_dequantize_where_the_kernel_does_not_run() -> None:
    q, s, b = random_packed(64, 256, 64, seed=1)
    assert not dequant_kernel.takes(q, s, 4, 64)  # this CPU
    assert mx.array_equal(dequant_kernel.dequantize(q, s, b, 64, 4), mx.dequantize(q, s, b, group_size=64, bits=4))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_a_kernel_that_differs_from_mlx_at_its_first_call_is_not_used_on_that_shape(
    monkeypatch: pytest.MonkeyPatch, dtype: mx.Dtype
) -> None:
    """Fail closed: the first call on a shape compares the kernel's bits with ``mx.dequantize``'s, for bf16
    and for float16 scales (a GGUF model's on a GPU). The launch is replaced by stand-ins (named as such:
    the CUDA kernel cannot run here), one exact, one off by a bit."""
    q, s, b = random_packed(64, 256, 64, seed=2)
    s, b = s.astype(dtype), b.astype(dtype)
    want = mx.dequantize(q, s, b, group_size=64, bits=4)
    calls: list[str] = []

    def exact_stand_in(w: mx.array, sc: mx.array, bi: mx.array, gs: int) -> mx.array:
        calls.append("exact")
        return mx.dequantize(w, sc, bi, group_size=gs, bits=4)

    def off_stand_in(w: mx.array, sc: mx.array, bi: mx.array, gs: int) -> mx.array:
        calls.append("off")
        out = mx.dequantize(w, sc, bi, group_size=gs, bits=4)
        return (out.view(mx.uint16) ^ 1).view(out.dtype)

    monkeypatch.setattr(dequant_kernel, "_checked", {})
    monkeypatch.setattr(dequant_kernel, "launch_seam", exact_stand_in)
    assert dequant_kernel.takes(q, s, 4, 64)
    for _ in range(2):
        assert mx.array_equal(dequant_kernel.dequantize(q, s, b, 64, 4), want)
    assert calls == ["exact", "exact"] and dequant_kernel._checked == {(64, 32, 64, dtype): True}
    assert dequant_kernel.dequantize(q, s, b, 64, 4).dtype == dtype
    monkeypatch.setattr(dequant_kernel, "launch_seam", off_stand_in)
    monkeypatch.setattr(dequant_kernel, "_checked", {})
    calls.clear()
    for _ in range(2):
        got = dequant_kernel.dequantize(q, s, b, 64, 4)
        assert got.view(mx.uint16).tolist() == want.view(mx.uint16).tolist()
    assert calls == ["off"] and dequant_kernel._checked == {(64, 32, 64, dtype): False}
