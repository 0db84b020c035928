"""The Marlin-style w4a16 kernel's repack and per-lane index math, checked on the CPU.

``benchmarks/w4a16_marlin.py``'s ``repack`` must round-trip MLX's 4-bit arrays bit for bit, and its numpy
emulation of the kernel (which word and scale pair each lane loads, which nibbles become which MMA
fragment register, ``ldmatrix`` addresses, the C store and the split-K reduction) must reproduce
``x @ W.T`` on every projection shape, with ``W`` MLX CUDA's dequantized weights (``scale * q + bias`` as
one bf16 FMA: nvcc fuses MLX's expression, as ``tools/nvrtc``'s machine code of it shows): weights bit for
bit, products to float32 accumulation order. No CUDA needed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest

from tests.helpers.packed import random_packed

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "w4a16_marlin.py"


def _load() -> ModuleType:
    sys.path.insert(0, str(_PATH.parent))  # its sibling modules (the CUDA text, the emulator)
    spec = importlib.util.spec_from_file_location("w4a16_marlin", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["w4a16_marlin"] = mod
    spec.loader.exec_module(mod)
    return mod


w4m = _load()

LLAMA_8B = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
SMOLLM2 = [(576, 576), (192, 576), (1536, 576), (576, 1536)]


def _x(m: int, k: int, seed: int) -> mx.array:
    return (mx.random.normal((m, k), key=mx.random.key(seed)) * 0.5).astype(mx.bfloat16)


def _ref(x: mx.array, q: mx.array, s: mx.array, b: mx.array, gs: int) -> np.ndarray:
    wd = w4m.cuda_dequantize(q, s, b, gs)
    return np.array(x.astype(mx.float32)) @ wd.T


def test_cuda_dequantize_rounds_once_where_the_cpu_rounds_twice() -> None:
    """The kernels' target: ``bf16(s q + b)``. MLX's CPU ``mx.dequantize`` gives ``bf16(bf16(s q) + b)``,
    a rounding of ``s q`` away at some weights; the two agree everywhere else."""
    q, s, b = random_packed(576, 1536, 64, seed=9)
    fused = w4m.cuda_dequantize(q, s, b, 64)
    cpu = np.array(mx.dequantize(q, s, b, group_size=64, bits=4).astype(mx.float32))
    differ = fused != cpu
    assert 0 < differ.mean() < 0.5
    assert np.abs(fused - cpu).max() <= 2.0**-7 * np.abs(cpu).max()  # a rounding of s q apart, not another weight


@pytest.mark.parametrize(
    "n,k,gs",
    [(n, k, 64) for n, k in LLAMA_8B] + [(n, k, gs) for n, k in SMOLLM2 for gs in (32, 64)] + [(256, 1024, 128)],
)
def test_repack_round_trips_bit_for_bit_at_mlx_size(n: int, k: int, gs: int) -> None:
    q, s, b = random_packed(n, k, gs, seed=n + k + gs)
    packed = w4m.pack(q, s, b, gs)
    assert packed.wq.shape == (n // 16, 2 * k) and packed.wq.dtype == mx.uint32
    back = w4m.unrepack(packed.wq, packed.sb, gs)
    for got, want in zip(back, (q, s, b)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want).item()
    assert packed.nbytes <= 1.15 * (q.nbytes + s.nbytes + b.nbytes)


@pytest.mark.parametrize("n,k,gs", [(192, 576, 32), (576, 576, 64), (256, 1024, 128)])
def test_emulated_weights_are_mlx_cuda_dequantize_bit_for_bit(n: int, k: int, gs: int) -> None:
    """x = I: the emulated kernel's output is the dequantized weight it builds in registers."""
    q, s, b = random_packed(n, k, gs, seed=3)
    packed = w4m.pack(q, s, b, gs)
    eye = mx.eye(k, dtype=mx.bfloat16)
    got = w4m.emulate(eye, packed, w4m.plan(k, n, k))
    assert np.array_equal(got.T, w4m.cuda_dequantize(q, s, b, gs))


def _check(n: int, k: int, gs: int, m: int, p: object = None) -> None:
    q, s, b = random_packed(n, k, gs, seed=n * 3 + k + m)
    x = _x(m, k, seed=m + n)
    plan = p if p is not None else w4m.plan(m, n, k)
    got = w4m.emulate(x, w4m.pack(q, s, b, gs), plan)
    ref = _ref(x, q, s, b, gs)
    assert not np.isnan(got).any(), "an output no lane stores"
    tol = 1e-5 * max(1.0, float(np.abs(ref).max()))
    assert np.abs(got - ref).max() <= tol


@pytest.mark.parametrize("n,k", LLAMA_8B)
def test_emulated_kernel_matches_reference_on_8b_shapes(n: int, k: int) -> None:
    _check(n, k, 64, 16)


@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 64, 100, 256])
@pytest.mark.parametrize("n,k,gs", [(192, 576, 32), (576, 1536, 64)])
def test_emulated_kernel_matches_reference_at_every_row_tile(n: int, k: int, gs: int, m: int) -> None:
    _check(n, k, gs, m)


@pytest.mark.parametrize("n,k", SMOLLM2)
@pytest.mark.parametrize("gs", [32, 64])
def test_emulated_kernel_matches_reference_on_smollm2_shapes(n: int, k: int, gs: int) -> None:
    _check(n, k, gs, 16)


@pytest.mark.parametrize(
    "fields",
    [
        dict(mt=2, nb=1, warps=4, splits=3),
        dict(mt=4, nb=4, warps=2, splits=1),
        dict(mt=1, nb=2, warps=8, splits=5),
        dict(mt=1, nb=2, warps=4, splits=4, reduce=False),
    ],
)
def test_emulated_kernel_matches_reference_for_forced_plans(fields: dict) -> None:
    """Odd splits (uneven K slices, a partial last chunk), blocks past N, the MLX-sum reduction."""
    _check(576, 1216, 64, 40, w4m.Plan(**fields))


def test_plan_fills_the_gpu_and_splits_small_outputs() -> None:
    p = w4m.plan(16, 1024, 4096)
    gx, gy, gz = p.grid(16, 1024)
    assert gz > 1 and (gx // (32 * p.warps)) * gy * gz >= w4m.SMS
    assert w4m.plan(256, 14336, 4096).splits == 1
    assert p.tiles(16, 1024) <= 1024  # the counters a weight holds (one an output)
    for m in (1, 16, 32, 64, 256):  # default plans stay within the default 48 KB of dynamic shared memory
        q = w4m.plan(m, 4096, 4096)
        assert q.shared_bytes() <= 48000 and q.xbuf == (2 if q.mt <= 2 else 1)


def test_bad_shapes_are_refused() -> None:
    q, s, b = random_packed(200, 576, 64, seed=1)  # N % 16 != 0
    with pytest.raises(ValueError, match="w4a16: needs N % 16"):
        w4m.pack(q, s, b, 64)
    q, s, b = random_packed(192, 576, 96, seed=1)
    with pytest.raises(ValueError, match="w4a16: needs N % 16"):
        w4m.pack(q, s, b, 96)


# --- the native kernel: MLX's packed arrays read as they are


def _check_native(n: int, k: int, gs: int, m: int, p: object = None) -> None:
    q, s, b = random_packed(n, k, gs, seed=n * 5 + k + m)
    x = _x(m, k, seed=m + n + 1)
    plan = p if p is not None else w4m.plan(m, n, k)
    got = w4m.emulate_native(x, w4m.native(q, s, b, gs), plan)
    ref = _ref(x, q, s, b, gs)
    assert not np.isnan(got).any(), "an output no lane stores"
    tol = 1e-5 * max(1.0, float(np.abs(ref).max()))
    assert np.abs(got - ref).max() <= tol


def test_native_reads_mlx_arrays_without_a_copy() -> None:
    q, s, b = random_packed(576, 1536, 64, seed=2)
    nw = w4m.native(q, s, b, 64)
    assert nw.w is q and nw.scales is s and nw.biases is b
    assert nw.nbytes <= 1.15 * (q.nbytes + s.nbytes + b.nbytes)
    with pytest.raises(ValueError, match="w4a16: needs bf16"):
        w4m.native(q, s.astype(mx.float16), b, 64)


@pytest.mark.parametrize("n,k,gs", [(192, 576, 32), (576, 576, 64), (256, 1024, 128)])
def test_native_emulated_weights_are_mlx_cuda_dequantize_bit_for_bit(n: int, k: int, gs: int) -> None:
    """x = I: the emulated native kernel's output is the dequantized weight it builds in registers."""
    q, s, b = random_packed(n, k, gs, seed=4)
    got = w4m.emulate_native(mx.eye(k, dtype=mx.bfloat16), w4m.native(q, s, b, gs), w4m.plan(k, n, k))
    assert np.array_equal(got.T, w4m.cuda_dequantize(q, s, b, gs))


@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 14336)])
def test_native_emulated_kernel_matches_reference_on_8b_shapes(n: int, k: int) -> None:
    _check_native(n, k, 64, 16)


@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("n,k,gs", [(192, 576, 32), (576, 1536, 64), (256, 1024, 128)])
def test_native_emulated_kernel_matches_reference_at_every_row_tile(n: int, k: int, gs: int, m: int) -> None:
    _check_native(n, k, gs, m)


@pytest.mark.parametrize(
    "fields",
    [
        dict(mt=2, nb=1, warps=4, splits=3, stages=3),
        dict(mt=4, nb=4, warps=2, splits=1, stages=2),
        dict(mt=1, nb=2, warps=8, splits=5, stages=4),
        dict(mt=1, nb=2, warps=4, splits=4, reduce=False, stages=2),
    ],
)
def test_native_emulated_kernel_matches_reference_for_forced_plans(fields: dict) -> None:
    """Uneven K slices shorter and longer than the pipeline, blocks past N, the MLX-sum reduction."""
    _check_native(576, 1216, 64, 40, w4m.Plan(**fields))


def test_a_tile_s_register_cap_is_its_plan_s_and_reaches_the_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """``REGISTER_CAPS`` sets ``plan``'s ``regs`` for its tile only (a forced ``regs`` wins); the cap is a
    template argument (``jit_cache.REGISTER_CAP``, so NVRTC gets it) and in the kernel's name."""
    from workers.kernels import jit_cache, w4a16, w4a16_source

    monkeypatch.setitem(w4a16_source.REGISTER_CAPS, (4, 2, 4), 128)
    capped, other = w4a16.plan(256, 4096, 4096), w4a16.plan(16, 4096, 4096)
    assert (capped.mt, capped.regs, other.mt, other.regs) == (4, 128, 1, 0)
    assert w4a16.plan(256, 4096, 4096, regs=168).regs == 168
    args = dict(w4a16.template(w4a16.NATIVE, capped, 64, True, True))
    assert args[jit_cache.REGISTER_CAP] == 128
    assert jit_cache.options(list(args.items())) == ("--maxrregcount=128",)
    assert jit_cache.options(list(dict(w4a16.template(w4a16.NATIVE, other, 64, True, True)).items())) == ()
    names = {w4a16.kernel_name(w4a16.NATIVE, p, 64, True, True) for p in (capped, w4a16.plan(256, 4096, 4096, regs=0))}
    assert len(names) == 2


def test_native_plans_fit_default_shared_memory() -> None:
    for m in (1, 16, 32, 64, 256):
        for nb in (1, 2, 4):
            p = w4m.plan(m, 4096, 4096, nb=nb)
            assert 2 <= p.stages <= 4 and p.native_shared_bytes() <= 48000
    assert w4m.plan(16, 4096, 4096).stages == 4


def test_native_source_holds_the_emulated_index_math() -> None:
    """The CUDA text and ``emulate_native`` describe the same swizzles, shifts, pairs and ring slots."""
    for expr in (
        "(u ^ ((r & 1) << 2))",
        "((mi & 1) ^ ((r >> 2) & 1))",
        "8 * (mi >> 1) + (lane & 7)",
        "wv >> (8 * u)",
        "wv >> (8 * u + 4)",
        "__byte_perm(lo.x, lo.z, 0x5410)",
        "__byte_perm(lo.y, lo.w, 0x7632)",
        "GPS == 1 ? 0 : c32",
        "(p + ST - 1) % ST",
        "o + 8 * (size_t)G",
        "min(n_cta + r, N - 1)",
    ):
        assert expr in w4m.w4a16.NATIVE.source, expr
