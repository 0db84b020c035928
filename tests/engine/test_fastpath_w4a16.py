"""Batched decode through the w4a16 tensor-core kernel (``fastpath.MMA``, ``workers.kernels.w4a16``).

The CUDA kernel cannot run on this CPU (its numerics are checked on the device, ``pytest -m gpu``, and
its index math in tests/unit/test_w4a16_marlin.py): its launch is replaced by a stand-in (named as
such, ``w4a16.launch_seam``) that records each launch and computes ``x @ dequantize(w).T``. What is
tested here is the routing: which calls reach the kernel, the plans that send them, and their store.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.helpers.fastpath import policy as policy
from tests.reference import load_measured
from workers.engine.engine import Engine
from workers.kernels import fastpath, plan_store, plan_timing, plan_units, w4a16, w4a16_source
from workers.models import cache_dir
from workers.models.synthetic import llama_config, write_model

pytestmark = pytest.mark.usefixtures("clean_kernel_state", "policy")

MMA = fastpath.MMA
#: The plan of each launch the stand-in saw (``launches``).
tiles_launched: list[w4a16.Plan] = []


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Stand-in for the CUDA launch; yields the (rows, outputs) of each launch (and records each
    launch's plan in ``tiles_launched``)."""
    monkeypatch.setenv("MLX_BATCHD_W4A16", "1")
    monkeypatch.setattr(w4a16, "_takes", {})
    monkeypatch.setattr(w4a16, "_weights", {})
    monkeypatch.setattr(w4a16, "_checked", {})
    monkeypatch.setattr(fastpath, "_plans", {})
    monkeypatch.setattr(fastpath, "one_row", set())
    seen: list[tuple[int, int]] = []
    tiles_launched.clear()

    def stand_in(x: mx.array, w: w4a16.Native, p: w4a16.Plan) -> mx.array:
        seen.append((x.shape[0], w.n))
        tiles_launched.append(p)
        return (x @ mx.dequantize(w.w, w.scales, w.biases, w.group_size).T).astype(x.dtype)

    monkeypatch.setattr(w4a16, "launch_seam", stand_in)
    yield seen


def _last_way_cheapest(calls: list[Any], *_: Any) -> list[float]:
    """Timings in which the last way asked for (the w4a16 kernel, where offered) is the cheapest."""
    return [1.0] * (len(calls) - 1) + [0.5]


def _plans_kept(model: Any, rows: int, installs: list[Any]) -> list[float]:
    """Forward timings in which the per-shape plans (the first candidate) are the cheapest."""
    return [0.5] + [1.0] * (len(installs) - 1)


def _q(d_in: int, d_out: int, bits: int = 4, dtype: mx.Dtype = mx.bfloat16) -> nn.QuantizedLinear:
    q = nn.QuantizedLinear(d_in, d_out, bits=bits, group_size=64)
    q.set_dtype(dtype)
    return q


def test_the_kernel_takes_only_4_bit_bf16_or_float16_layers_of_shapes_it_runs(launches: list[Any]) -> None:
    assert w4a16.takes(_q(256, 64))
    assert w4a16.takes(_q(256, 64, dtype=mx.float16))  # a GGUF model's scales on a GPU
    assert not w4a16.takes(_q(256, 64, bits=8))
    assert not w4a16.takes(_q(256, 64, dtype=mx.float32))  # scales neither bf16 nor float16
    assert not w4a16.takes(_q(256, 72))  # 72 outputs: not a multiple of 16
    assert not w4a16.takes(nn.Linear(256, 64))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_a_tile_off_from_mlx_at_its_first_call_on_a_shape_is_not_used_there(
    launches: list[Any], monkeypatch: pytest.MonkeyPatch, dtype: mx.Dtype
) -> None:
    """Fail closed: a launch plan's first call on a weight shape is compared with MLX's dense product on
    seeded random rows. An exact stand-in is kept (and later calls are not compared again); a stand-in
    whose outputs are permuted (a wrong index) is refused on that shape and plan, for the rest of the
    process, even where the caller's rows are zeros, and another tile's plan is compared on its own. The
    activations reach the launch in the scales' dtype."""
    q = _q(256, 64, dtype=dtype)
    x = (mx.random.normal((32, 256), key=mx.random.key(3)) * 0.5).astype(mx.float32)
    dense = mx.dequantize(q.weight, q.scales, q.biases, group_size=64, bits=4)
    got = w4a16.project(q, x)
    assert got is not None and got.dtype == mx.float32 and len(launches) == 2  # the check's launch, then x's
    assert mx.array_equal(got, (x.astype(dtype) @ dense.T + q.bias).astype(mx.float32)).item()
    p0, p1 = w4a16.tile_plan(32, 64, 256, 0), w4a16.tile_plan(32, 64, 256, 1)
    assert p0 != p1 and w4a16._checked == {(64, 256, 64, dtype, p0): True}
    seen_dtypes: list[mx.Dtype] = []

    def permuted_stand_in(xs: mx.array, w: w4a16.Native, p: w4a16.Plan) -> mx.array:
        seen_dtypes.append(xs.dtype)
        return (xs @ mx.dequantize(w.w, w.scales, w.biases, w.group_size).T)[:, ::-1]

    monkeypatch.setattr(w4a16, "launch_seam", permuted_stand_in)
    assert w4a16.project(q, x) is not None  # tile 0 was checked already: not compared again
    assert w4a16.project(q, x, 1) is None  # tile 1's first call: off, refused
    assert w4a16.project(q, x, 1) is None and len(seen_dtypes) == 2  # refused without a launch
    assert seen_dtypes == [dtype, dtype]
    # The check runs on rows of its own, not the caller's: a calibration's first call is on zeros, where
    # any kernel's outputs agree.
    p2 = w4a16.tile_plan(32, 64, 256, 2)
    assert p2 not in (p0, p1) and w4a16.project(q, mx.zeros((32, 256)), 2) is None
    assert w4a16._checked == {
        (64, 256, 64, dtype, p0): True,
        (64, 256, 64, dtype, p1): False,
        (64, 256, 64, dtype, p2): False,
    }


def test_the_kernel_is_off_without_cuda_and_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(w4a16, "launch_seam", None)
    monkeypatch.setenv("MLX_BATCHD_W4A16", "1")
    assert not w4a16.available()  # this machine has no CUDA
    assert not w4a16.takes(_q(256, 64))
    monkeypatch.setattr(w4a16, "launch_seam", lambda x, w, p: x)
    for on in ("1", ""):  # switched on, and the default
        monkeypatch.setenv("MLX_BATCHD_W4A16", on)
        assert w4a16.takes(_q(256, 64))
    monkeypatch.setenv("MLX_BATCHD_W4A16", "0")
    assert not w4a16.takes(_q(256, 64))


def test_calibration_plans_the_kernel_where_cheapest_and_times_the_large_row_counts(
    launches: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_timing, "_ms", _last_way_cheapest)
    monkeypatch.setattr(plan_timing, "forward_ms", _plans_kept)
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=10))
    q = _q(256, 64)
    model = nn.Sequential(nn.Linear(256, 256), q)
    plans = plan_units.calibrate(model)
    q_plan = plans["QuantizedLinear(64, 32)/4"]
    # Below TILE_ROWS the kernel is one way (its own tile); from there every tile is timed, the last cheapest.
    last = MMA - (len(w4a16_source.TILES) - 1)
    small = [r for r in (*range(2, 11), *fastpath.LARGE_ROWS) if r < w4a16_source.TILE_ROWS]
    assert q_plan == {r: MMA if r in small else last for r in (*range(2, 11), *fastpath.LARGE_ROWS)}
    assert set(plans["Linear(256, 256)/None"]) == set(range(2, 11))  # not quantized: no w4a16 rows
    summary = fastpath.plans_summary(plans)["QuantizedLinear(64, 32)/4"]
    assert summary.startswith("2:m 3:m ") and summary.endswith(f"256:m{len(w4a16_source.TILES) - 1}")


def test_only_the_large_row_counts_a_step_of_max_batch_sequences_can_reach_are_timed() -> None:
    assert fastpath.large_rows() == fastpath.large_rows(None) == (32, 64, 128, 256)
    assert fastpath.large_rows(1) == fastpath.large_rows(32) == (32,)
    assert fastpath.large_rows(33) == (32, 64)
    assert fastpath.large_rows(100) == (32, 64, 128)
    assert fastpath.large_rows(256) == fastpath.large_rows(4096) == (32, 64, 128, 256)


def test_an_engine_times_and_stores_plans_for_the_row_counts_its_max_batch_reaches(
    launches: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An engine of ``max_batch`` sequences times no large row count its steps cannot reach, keeps its
    plans under a key of their own (a larger ``max_batch`` times the rest), and a step beyond the largest
    timed count (none can come) would take that count's plan."""
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(plan_timing, "_ms", _last_way_cheapest)
    monkeypatch.setattr(plan_timing, "forward_ms", _plans_kept)
    monkeypatch.setattr(fastpath, "LARGE_ROWS", (16, 32, 64))  # fewer forwards: this CPU's are slow
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=4))
    model = _llama(tmp_path)
    seen: dict[int, set[int]] = {}
    for max_batch in (16, 20):
        engine = Engine(model, eos_token_ids=(), vocab_size=256, calibration="now", max_batch=max_batch)
        assert engine.kernel_plans
        quantized = [m for m, shape in fastpath._projections(model) if "Quantized" in shape]
        seen[max_batch] = {r for m in quantized for r in fastpath._plans[id(m)]}
        if max_batch == 16:
            assert {fastpath.planned(id(m), 40) for m in quantized} == {MMA}  # the 16-row count's plan
    assert seen[16] == {2, 3, 4, 16} and seen[20] == {2, 3, 4, 16, 32}
    assert len(list((tmp_path / "cache" / "kernel-plans").glob("*[0-9a-f].json"))) == 2


def test_a_plan_s_tile_reaches_the_launch(launches: list[Any], tmp_path: Path) -> None:
    """Each plan value at or below ``MMA`` launches the kernel with its tile of ``TILES`` forced."""
    fastpath.set_active(fastpath.CUDA)
    model = _llama(tmp_path)
    shapes = {shape for _, shape in fastpath._projections(model)}
    for tile, want in enumerate(w4a16_source.TILES):
        plans = {s: {r: (MMA - tile if "Quantized" in s else r) for r in range(2, 5)} for s in shapes}
        fastpath.install(model, plans)
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((4, 2), dtype=mx.int32), cache=cache))
        tiles_launched.clear()
        mx.eval(model(mx.zeros((4, 1), dtype=mx.int32), cache=cache))
        assert tiles_launched, tile
        for p in tiles_launched:
            assert p.mt == (want.mt or 1) and p.nb == (want.nb or 2) and p.reduce == want.reduce, (tile, p)


def test_flattened_is_kept_where_the_kernel_is_not_cheaper(
    launches: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_timing, "_ms", lambda calls, *_: [1.0] * len(calls))
    monkeypatch.setattr(plan_timing, "forward_ms", _plans_kept)
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=4))
    plans = plan_units.calibrate(nn.Sequential(_q(256, 64)))
    assert plans["QuantizedLinear(64, 32)/4"] == {r: r for r in (2, 3, 4, *fastpath.LARGE_ROWS)}


def test_a_row_count_takes_the_plan_of_the_next_large_row_count_up() -> None:
    plan = {2: 2, 16: 16, 32: 32, 64: MMA, 128: MMA, 256: 256}
    assert fastpath.lookup(plan, 16) == 16
    assert fastpath.lookup(plan, 20) == 20  # up to 32: flattened as 32 is
    assert fastpath.lookup(plan, 33) == MMA and fastpath.lookup(plan, 128) == MMA
    assert fastpath.lookup(plan, 129) == 129 and fastpath.lookup(plan, 1000) == 1000  # 256's, beyond too
    assert fastpath.lookup({2: 2, 32: MMA}, 17) == MMA and fastpath.lookup({2: 2, 32: MMA}, 900) == MMA
    assert fastpath.lookup({2: 2}, 300) == 300  # no large rows planned: flattened
    assert fastpath.lookup({2: 2, 64: MMA - 1, 128: MMA - 3}, 100) == MMA - 3  # a tile's value carries over


def _llama(tmp_path: Path) -> nn.Module:
    return load_measured(write_model(tmp_path / "q4", llama_config(quant_bits=4), seed=3))


def _route_all_to_the_kernel(model: nn.Module) -> dict[str, dict[int, int]]:
    shapes = {shape for _, shape in fastpath._projections(model)}
    plans = {s: {r: (MMA if "Quantized" in s else r) for r in range(2, 17)} for s in shapes}
    fastpath.install(model, plans)
    return plans


def test_decode_steps_reach_the_kernel_and_prefill_and_one_row_do_not(launches: list[Any], tmp_path: Path) -> None:
    fastpath.set_active(fastpath.CUDA)
    model = _llama(tmp_path)
    _route_all_to_the_kernel(model)
    quantized = sum(1 for m, _ in fastpath._projections(model) if isinstance(m, nn.QuantizedLinear))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((4, 3), dtype=mx.int32), cache=cache))  # prefill: 12 rows, planned to the kernel
    assert launches == []
    mx.eval(model(mx.zeros((4, 1), dtype=mx.int32), cache=cache))  # a decode step of 4 sequences
    # (each launch plan's first call on a shape is checked first: one launch more for each)
    assert len(launches) == quantized + len(w4a16._checked) and all(rows == 4 for rows, _ in launches)
    launches.clear()
    mx.eval(model(mx.zeros((4, 1), dtype=mx.int32), cache=cache))  # the next: one launch a projection
    assert len(launches) == quantized and all(rows == 4 for rows, _ in launches)
    launches.clear()
    one = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 1), dtype=mx.int32), cache=one))  # classic B = 1 decode
    assert launches == []


def test_the_kernel_output_replaces_mlx_s_call_row_for_row(launches: list[Any], tmp_path: Path) -> None:
    """Each sequence's logits through the kernel route match MLX's call on the same rows (within what
    the stand-in's dequantize-then-matmul rounds differently): no row dropped, mixed or reordered."""
    fastpath.set_active(fastpath.CUDA)
    model = _llama(tmp_path)
    tokens = mx.array([[3], [7], [11], [19]], dtype=mx.int32)

    def step() -> mx.array:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[1, 2], [5, 6], [9, 10], [13, 14]], dtype=mx.int32), cache=cache))
        out = model(tokens, cache=cache)
        mx.eval(out)
        return out.astype(mx.float32)

    mlx_way = step()
    _route_all_to_the_kernel(model)
    kernel_way = step()
    assert launches
    swapped = mx.concatenate([mlx_way[1:2], mlx_way[0:1], mlx_way[2:]])
    near = float(mx.abs(kernel_way - mlx_way).mean().item())  # type: ignore[arg-type]
    far = float(mx.abs(kernel_way - swapped).mean().item())  # type: ignore[arg-type]
    assert near < 0.1 * far  # bf16 rounding, not another row's logits


def test_stored_plans_keep_the_kernel_and_forged_values_are_refused(launches: list[Any], tmp_path: Path) -> None:
    shapes = ["QuantizedLinear(64, 32)/4"]
    large = fastpath.LARGE_ROWS
    plans = {shapes[0]: {**{r: MMA for r in range(2, 5)}, **{r: MMA for r in large}}}
    got, stored = plan_store.load_or_time(tmp_path, shapes, 4, (8, 16), lambda: plans, 0, large)
    assert got == plans and not stored
    again, stored = plan_store.load_or_time(tmp_path, shapes, 4, (8, 16), lambda: {}, 0, large)
    assert again == plans and stored
    with pytest.raises(ValueError, match="planned to -2"):  # timed without the kernel: no -2
        plan_store.valid({shapes[0]: {**{r: MMA for r in range(2, 5)}}}, shapes, 4, (8, 16))
    with pytest.raises(ValueError, match="256 rows planned to 16"):  # a large row count padded down
        plan_store.valid({shapes[0]: {**{r: r for r in range(2, 5)}, 256: 16}}, shapes, 4, (8, 16), 0, large)
    tiles = {r: MMA - (len(w4a16_source.TILES) - 1) for r in large}  # the last tile
    assert plan_store.valid({shapes[0]: {2: 2, 3: 3, 4: 4, **tiles}}, shapes, 4, (8, 16), 0, large)
    beyond = MMA - len(w4a16_source.TILES)
    with pytest.raises(ValueError, match=f"256 rows planned to {beyond}"):  # no such tile
        plan_store.valid({shapes[0]: {2: 2, 3: 3, 4: 4, **tiles, 256: beyond}}, shapes, 4, (8, 16), 0, large)
    with pytest.raises(ValueError, match="one row planned to -2"):
        plan_store.valid({shapes[0]: {1: MMA, **{r: r for r in range(2, 5)}}}, shapes, 4, (8, 16), 0, large)
    assert plan_store.plan_key(shapes, 4, (8, 16), large) != plan_store.plan_key(shapes, 4, (8, 16))


def test_stored_plans_are_warmed_between_steps_before_they_are_installed(
    launches: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose plans are in the store serves with none installed while their kernels are
    warmed a forward a unit (each kernel compiles at its first call), then installs them."""
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fastpath, "LARGE_ROWS", (16, 32))  # fewer warm forwards: this CPU's are slow
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=4))
    model = _llama(tmp_path)
    shapes = plan_units.shapes_of(model)
    assert shapes is not None and shapes.large == fastpath.LARGE_ROWS
    # In the store as a calibration would leave them: the kernel at 3-4 rows and every large count.
    kernel = {2: 2, 3: MMA, 4: MMA, **dict.fromkeys(fastpath.LARGE_ROWS, MMA)}
    flat = {r: r for r in (2, 3, 4, *fastpath.LARGE_ROWS)}
    stored = {name: dict(kernel if "Quantized" in name else flat) for name in shapes.names}
    shapes.load_or_time(cache_dir() / "kernel-plans", lambda: stored)
    rows = plan_units.warm_rows(model, stored)
    assert rows == [3, 4, *fastpath.LARGE_ROWS]

    engine = Engine(model, eos_token_ids=(), vocab_size=256, calibration="background")
    assert engine.starting and fastpath.installed(model) == {} and launches == []
    warmed: list[int] = []
    while engine.background.pending:
        engine.background.step()
        if engine.background.pending:  # between units: none installed
            assert fastpath.installed(model) == {}
        warmed += sorted({r for r, _ in launches})
        launches.clear()
    assert warmed == rows  # the kernel runs decode steps only: each row count's one-token forward
    assert fastpath.installed(model) == fastpath.plans_summary(stored) and engine.kernel_plans


def test_a_tile_with_more_steps_a_slice_caps_the_k_slices_of_narrow_outputs() -> None:
    """``Tile.min_steps``: at 32 rows k/v (1024 outputs, K 4096) gets 32 slices of two k64 steps from the
    default tile and at most 64 / 8 from the capped ones; wide outputs, already split little, keep theirs."""
    capped = [i for i, t in enumerate(w4a16_source.TILES) if t.min_steps > 2]
    assert capped
    assert w4a16.tile_plan(32, 1024, 4096, 0).splits == 32
    for i in capped:
        t = w4a16_source.TILES[i]
        assert w4a16.tile_plan(32, 1024, 4096, i).splits <= 64 // t.min_steps
        assert w4a16.tile_plan(32, 14336, 4096, i).splits <= w4a16.tile_plan(32, 14336, 4096, 0).splits
    assert w4a16.plan(32, 1024, 4096, min_steps=64).splits == 1
