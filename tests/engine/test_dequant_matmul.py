"""Large batches through a transient dequantized weight (``fastpath.DEQUANT``, ``workers.kernels.dequant_matmul``).

The way itself is MLX's own ops (dequantize, then a matmul), so it runs here for real; only its offer on
this CPU is forced (``dequant_matmul.anywhere``: the plans of MLX CUDA alone time it otherwise). What is
tested: its arithmetic (the dense shadow's), its slicing of large weights, which calls reach it, the
plans that send them and their store.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.helpers.fastpath import greedy_agreement, recorded_rows, topic_prompts
from tests.helpers.fastpath import policy as policy
from tests.reference import load_measured
from workers.kernels import dense_shadow, dequant_matmul, fastpath, plan_store, plan_timing, plan_units
from workers.models.loading import load
from workers.models.synthetic import llama_config, write_model

pytestmark = pytest.mark.usefixtures("clean_kernel_state", "policy")

DEQUANT = fastpath.DEQUANT


@pytest.fixture
def offered(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The way offered on this CPU; yields the rows of each call that reached it."""
    monkeypatch.delenv("MLX_BATCHD_DEQUANT", raising=False)
    monkeypatch.delenv("MLX_BATCHD_W4A16", raising=False)
    monkeypatch.setattr(dequant_matmul, "anywhere", True)
    monkeypatch.setattr(fastpath, "_plans", {})
    monkeypatch.setattr(fastpath, "one_row", set())
    yield recorded_rows(monkeypatch, dequant_matmul)


def _q(d_in: int, d_out: int, bits: int = 4, bias: bool = False) -> nn.QuantizedLinear:
    q = nn.QuantizedLinear(d_in, d_out, bias=bias, bits=bits, group_size=64)
    q.set_dtype(mx.bfloat16)
    return q


def _x(rows: int, d_in: int) -> mx.array:
    return (mx.random.normal((rows, d_in), key=mx.random.key(rows)) * 0.5).astype(mx.bfloat16)


def _reference(m: nn.QuantizedLinear, x: mx.array) -> np.ndarray:
    """Float32 ``x @ dequantize(w).T (+ bias)``."""
    assert m.biases is not None
    w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(mx.float32)
    y = x.astype(mx.float32) @ w.T
    if "bias" in m:
        y = y + m.bias.astype(mx.float32)
    return np.array(y)


def test_it_takes_affine_4_and_8_bit_layers_only_where_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLX_BATCHD_DEQUANT", raising=False)
    assert not dequant_matmul.takes(_q(256, 64))  # this CPU: MLX CUDA's plans alone offer it
    monkeypatch.setattr(dequant_matmul, "anywhere", True)
    assert dequant_matmul.takes(_q(256, 64)) and dequant_matmul.takes(_q(256, 64, bits=8))
    assert not dequant_matmul.takes(nn.Linear(256, 64))
    monkeypatch.setenv("MLX_BATCHD_DEQUANT", "0")
    assert not dequant_matmul.takes(_q(256, 64))
    assert dequant_matmul.project(_q(256, 64), _x(4, 256)) is None


def test_its_output_is_the_dense_shadow_s_byte_for_byte(offered: list[int]) -> None:
    """The same arithmetic as the shadow (weight rounded to bf16, one matmul, the bias in it), made per call."""
    model = nn.Sequential(_q(256, 96, bias=True), _q(256, 64, bits=8))
    dense_shadow.build(model)
    try:
        for m in model.layers:
            x = _x(40, 256)
            got, shadow = dequant_matmul.project(m, x), dense_shadow.project(m, x)
            assert got is not None and shadow is not None
            assert got.dtype == mx.bfloat16 and np.array_equal(
                np.array(got.view(mx.uint16)), np.array(shadow.view(mx.uint16))
            )
    finally:
        dense_shadow.drop(model)


def test_slices_cover_every_output_once_within_the_byte_limit() -> None:
    assert dequant_matmul.slices(100, 64, chunk_bytes=1 << 20) == [(0, 100)]
    for n, k, limit in ((1000, 64, 20_000), (14336, 4096, 128 << 20), (128256, 4096, 128 << 20), (7, 64, 10)):
        parts = dequant_matmul.slices(n, k, chunk_bytes=limit)
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
        assert all(hi > lo and ((hi - lo) * k * 2 <= limit or hi - lo == 1) for lo, hi in parts)
        assert len(parts) == min(n, -(-(n * k * 2) // limit))  # no more slices than the limit needs
    assert len(dequant_matmul.slices(128256, 4096)) == 8  # an 8B's vocabulary head: 1 GB of bf16 in 8


def test_a_weight_over_the_byte_limit_is_multiplied_in_slices_into_the_right_columns(
    offered: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _q(256, 200, bias=True)
    x = _x(33, 256)
    whole = dequant_matmul.project(m, x)
    made: list[tuple[int, ...]] = []
    real = mx.dequantize

    def counting(w: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = real(w, *args, **kwargs)
        made.append(tuple(out.shape))
        return out

    monkeypatch.setattr(mx, "dequantize", counting)
    monkeypatch.setattr(dequant_matmul, "CHUNK_BYTES", 30 * 256 * 2)  # 30 outputs' rows: 7 slices
    sliced = dequant_matmul.project(m, x)
    assert whole is not None and sliced is not None and sliced.shape == (33, 200)
    assert len(made) == 7 and all(s[0] <= 30 for s in made) and sum(s[0] for s in made) == 200
    ref = _reference(m, x)
    for y in (whole, sliced):
        err = np.abs(np.array(y.astype(mx.float32)) - ref).max()
        assert err <= 2.0 ** (np.floor(np.log2(np.abs(ref).max())) - 7)  # one bf16 ulp of the largest output


def test_calibration_plans_it_from_its_first_row_count_where_cheapest(
    offered: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offered without the w4a16 kernel (this CPU), it alone brings the large row counts into the timing;
    each is planned to it where its timing is the cheapest (the last way asked for), never below ``MIN_ROWS``."""
    monkeypatch.setattr(plan_timing, "_ms", lambda calls, *_: [1.0] * (len(calls) - 1) + [0.5])
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=10))
    model = nn.Sequential(nn.Linear(256, 256), _q(256, 64))
    plans = plan_units.calibrate(model, max_batch=64)
    q_plan = plans["QuantizedLinear(64, 32)/4"]
    assert {r: to for r, to in q_plan.items() if r > 10} == {32: DEQUANT, 64: DEQUANT}
    assert all(to != DEQUANT for r, to in q_plan.items() if r < dequant_matmul.MIN_ROWS)
    assert set(plans["Linear(256, 256)/None"]) == set(range(2, 11))
    assert fastpath.plans_summary(plans)["QuantizedLinear(64, 32)/4"].endswith("32:q 64:q")


def test_decode_and_prefill_rows_planned_to_it_reach_it_and_match_the_reference(
    offered: list[int], tmp_path: Path
) -> None:
    fastpath.set_active(fastpath.CUDA)
    model = load_measured(write_model(tmp_path / "q4", llama_config(quant_bits=4), seed=3))
    shapes = {shape for _, shape in fastpath._projections(model)}
    fastpath.install(model, {s: {**{r: r for r in range(2, 17)}, 32: DEQUANT} for s in shapes})
    quantized = [m for m, _ in fastpath._projections(model) if isinstance(m, nn.QuantizedLinear)]
    for rows in (16, 20, 32, 40):  # 20: the 32-row plan; 40: past the largest, its plan too; 16: its own
        offered.clear()
        mx.eval(model(mx.zeros((rows, 1), dtype=mx.int32)))
        assert offered == ([] if rows == 16 else [rows] * len(quantized))
    offered.clear()
    mx.eval(model(mx.zeros((3, 8), dtype=mx.int32)))  # prefill: 24 rows flattened, the 32-row plan
    assert offered == [24] * len(quantized)
    m = quantized[0]
    x = _x(32, m.weight.shape[1] * 8)
    got = fastpath.project(
        lambda xs: m(xs), x.reshape(32, 1, -1), 32, id(m), dequant=lambda xs: dequant_matmul.project(m, xs)
    )[0]
    ref = _reference(m, x)
    assert np.abs(np.array(got.reshape(32, -1).astype(mx.float32)) - ref).max() <= 2.0 ** (
        np.floor(np.log2(np.abs(ref).max())) - 7
    )


def test_greedy_tokens_of_a_real_model_through_it_agree_with_mlx_s_kernels(
    offered: list[int], smollm2_dir: Path
) -> None:
    """The agreement the GPU tests report (``greedy_agreement``), here on the CPU with the real instruct
    model: every decode row count planned to the transient weight reaches it, and the greedy tokens
    stay MLX's (a wrong product, its outputs permuted, left 0 of 128 equal)."""
    fastpath.set_active(fastpath.CUDA)
    loaded = load(str(smollm2_dir), widths=False)
    prompts = topic_prompts(loaded.tokenizer, 8)
    agreed, total = greedy_agreement(loaded.model, loaded.info.vocab_size, prompts, 12, DEQUANT, offered)
    assert total == 96 and agreed >= 0.9 * total
    assert 8 in offered  # the decode steps' 8 rows went through it


def test_the_store_keeps_it_from_its_first_row_count_and_apart_from_plans_timed_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shapes = ["QuantizedLinear(64, 32)/4"]
    large = (32, 64)
    small = {r: r for r in range(2, 5)}
    ok = {shapes[0]: {**small, 32: DEQUANT, 64: DEQUANT}}
    assert plan_store.valid(ok, shapes, 4, (8, 16), 0, large) == ok
    with pytest.raises(ValueError):
        plan_store.valid(ok, shapes, 4, (8, 16))  # no large rows timed: no way to plan it
    with pytest.raises(ValueError):
        plan_store.valid({shapes[0]: {**small, 4: DEQUANT, 32: 32, 64: 64}}, shapes, 4, (8, 16), 0, large)
    monkeypatch.delenv("MLX_BATCHD_DEQUANT", raising=False)
    with_it = plan_store.plan_key(shapes, 4, (8, 16), large)
    monkeypatch.setenv("MLX_BATCHD_DEQUANT", "0")
    assert plan_store.plan_key(shapes, 4, (8, 16), large) != with_it
