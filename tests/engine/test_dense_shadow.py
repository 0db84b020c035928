"""The dequantized shadow of the quantized projections (``serve --dense-shadow``, ``workers.kernels.dense_shadow``).

Routing through it is a plan value (``fastpath.DENSE``) that calibration picks per shape and row count
only where it timed cheaper; the timings are replaced here (``plan_timing._ms``, ``forward_ms``) so the
choice is the test's, while the forwards, the shadow and the plans' store are real.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.helpers.fastpath import policy as policy
from tests.helpers.fastpath import recorded_rows
from tests.reference import load_measured
from workers.api import Level
from workers.engine.engine import Engine
from workers.engine.stats import engine_snapshot
from workers.kernels import dense_shadow, fastpath, plan_store, plan_timing, plan_units
from workers.kernels.levels import scoped
from workers.models.synthetic import llama_config, write_model

pytestmark = pytest.mark.usefixtures("clean_kernel_state", "policy")

DENSE = fastpath.DENSE
QUANTIZED = "QuantizedLinear(64, 32)/4"


@pytest.fixture
def dense_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The rows of each projection call that went through the shadow (the real ``dense_shadow.project``)."""
    monkeypatch.setattr(fastpath, "_plans", {})
    monkeypatch.setattr(fastpath, "one_row", set())
    monkeypatch.setattr(dense_shadow, "_dense", {})
    monkeypatch.setattr(dense_shadow, "_chosen", {})
    yield recorded_rows(monkeypatch, dense_shadow)


def _last_way_cheapest(calls: list[Any], *_: Any) -> list[float]:
    """Timings in which the last way asked for (the shadow, where offered) is the cheapest."""
    return [1.0] * (len(calls) - 1) + [0.5]


def _first_kept(model: Any, rows: int, installs: list[Any]) -> list[float]:
    """Forward timings in which the per-shape plans (the first candidate) are the cheapest."""
    return [0.5] + [1.0] * (len(installs) - 1)


def _last_forward_cheapest(model: Any, rows: int, installs: list[Any]) -> list[float]:
    return [1.0] * (len(installs) - 1) + [0.5]


def _q(d_in: int, d_out: int, bits: int = 4) -> nn.QuantizedLinear:
    q = nn.QuantizedLinear(d_in, d_out, bits=bits, group_size=64)
    q.set_dtype(mx.bfloat16)
    return q


def _llama(tmp_path: Path) -> nn.Module:
    return load_measured(write_model(tmp_path / "q4", llama_config(quant_bits=4), seed=3))


def _calibrating() -> None:
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=16))


def test_calibration_picks_the_shadow_where_it_times_cheapest(
    dense_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_timing, "_ms", _last_way_cheapest)
    monkeypatch.setattr(plan_timing, "forward_ms", _first_kept)
    _calibrating()
    model = nn.Sequential(nn.Linear(256, 256), _q(256, 64))
    assert dense_shadow.configure(model, "on", 0).on
    plans = plan_units.calibrate(model)
    large = fastpath.LARGE_ROWS
    # From MIN_ROWS rows the shadow is offered (last) and cheapest; below it never offered.
    assert {r for r, to in plans[QUANTIZED].items() if to == DENSE} == {16, *large}
    assert all(to != DENSE for r, to in plans[QUANTIZED].items() if r < dense_shadow.MIN_ROWS)
    assert set(plans["Linear(256, 256)/None"]) == set(range(2, 17))  # no shadow: no large rows, no DENSE
    assert fastpath.plans_summary(plans)[QUANTIZED].endswith("16:d 32:d 64:d 128:d 256:d")


def test_calibration_keeps_mlx_s_call_where_the_shadow_is_not_cheaper(
    dense_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_timing, "_ms", lambda calls, *_: [1.0] * len(calls))
    monkeypatch.setattr(plan_timing, "forward_ms", _first_kept)
    _calibrating()
    model = nn.Sequential(_q(256, 64))
    dense_shadow.configure(model, "on", 0)
    plans = plan_units.calibrate(model)
    assert plans[QUANTIZED] == {r: r for r in (*range(2, 17), *fastpath.LARGE_ROWS)}


def test_the_forward_check_keeps_the_shadow_where_whole_decode_steps_are_cheaper(
    dense_calls: list[int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(plan_timing, "_ms", lambda calls, *_: [1.0] * len(calls))
    monkeypatch.setattr(plan_timing, "forward_ms", _last_forward_cheapest)
    monkeypatch.setattr(fastpath, "LARGE_ROWS", (32,))  # fewer forwards: this CPU's are slow
    _calibrating()
    model = _llama(tmp_path)
    dense_shadow.configure(model, "on", 0)
    plans = plan_units.calibrate(model)
    quantized = [s for s in plans if s.startswith("QuantizedLinear")]
    assert quantized and all(plans[s][16] == DENSE and plans[s][32] == DENSE for s in quantized)
    assert all(DENSE not in plan.values() for s, plan in plans.items() if s not in quantized)


def _step(model: nn.Module, tokens: mx.array) -> mx.array:
    cache = make_prompt_cache(model)
    rows = tokens.shape[0]
    mx.eval(model(mx.arange(2 * rows, dtype=mx.int32).reshape(rows, 2) % 200 + 1, cache=cache))
    out = model(tokens, cache=cache)
    mx.eval(out)
    return out.astype(mx.float32)


def _route_all_to_the_shadow(model: nn.Module, only: int = 0) -> None:
    """Every quantized projection planned to the shadow at 2..16 rows (``only``: at that row count alone)."""
    shapes = {shape for _, shape in fastpath._projections(model)}
    to = {s: {r: (DENSE if "Quantized" in s and only in (0, r) else r) for r in range(2, 17)} for s in shapes}
    fastpath.install(model, to)


def test_a_decode_step_through_the_shadow_gives_mlx_s_logits_row_for_row(
    dense_calls: list[int], tmp_path: Path
) -> None:
    """Each sequence's logits through the shadow match MLX's quantized call on the same rows within
    bf16 rounding (the shadow's weights are rounded to bf16 once, where MLX's kernel dequantizes in
    float): no row dropped, mixed or reordered. Only the decode step's 8 rows are planned to it."""
    fastpath.set_active(fastpath.CUDA)
    model = _llama(tmp_path)
    tokens = mx.array([[3], [7], [11], [19], [23], [29], [31], [37]], dtype=mx.int32)
    mlx_way = _step(model, tokens)
    assert dense_calls == []
    dense_shadow.configure(model, "on", 0)
    _route_all_to_the_shadow(model, only=8)
    dense_way = _step(model, tokens)
    quantized = sum(1 for m, _ in fastpath._projections(model) if isinstance(m, nn.QuantizedLinear))
    assert dense_calls == [8] * quantized  # the decode step's every quantized projection, prefill not
    # distance[i][j]: mean |logits| between row i through the shadow and row j as MLX computes it.
    distance = cast(list[list[float]], mx.abs(dense_way[:, None] - mlx_way[None, :]).mean(axis=(2, 3)).tolist())
    for i, row in enumerate(distance):
        others = min(d for j, d in enumerate(row) if j != i)
        assert row[i] < 0.1 * others, (i, row)  # bf16 rounding, not another row's logits
    assert bool(mx.all(mx.argmax(dense_way, axis=-1) == mx.argmax(mlx_way, axis=-1)).item())


def test_an_exact_level_never_routes_to_the_shadow(dense_calls: list[int], tmp_path: Path) -> None:
    fastpath.set_active(fastpath.CUDA)
    model = _llama(tmp_path)
    dense_shadow.configure(model, "on", 0)
    _route_all_to_the_shadow(model)
    tokens = mx.array([[3], [7], [11], [19]], dtype=mx.int32)
    for level in Level:
        if level is Level.WIDE:
            continue
        with scoped(level):
            _step(model, tokens)
        assert dense_calls == [], level
    _step(model, tokens)  # wide: the plans route it
    assert dense_calls


def test_off_makes_no_shadow_and_on_reports_its_bytes(dense_calls: list[int], tmp_path: Path) -> None:
    model = _llama(tmp_path)
    choice = dense_shadow.configure(model, "off", 0)
    assert not choice.on and dense_shadow.resident_bytes(model) == 0
    assert not any(dense_shadow.has(m) for m, _ in fastpath._projections(model))
    engine = Engine(model, eos_token_ids=(), vocab_size=256)
    unused: Any = {}
    assert engine_snapshot(engine, unused, unused, unused)["dense_shadow_bytes"] == 0
    assert "off (--dense-shadow off" in choice.line()

    choice = dense_shadow.configure(model, "on", 0)
    quantized = [m for m, _ in fastpath._projections(model) if isinstance(m, nn.QuantizedLinear)]
    want = sum(m.weight.shape[0] * m.weight.shape[1] * 8 * 2 for m in quantized)  # bf16, 8 weights a word
    assert choice.on and choice.nbytes == want and dense_shadow.resident_bytes(model) == want
    assert engine_snapshot(engine, unused, unused, unused)["dense_shadow_bytes"] == want
    assert choice.line().startswith("on, ")


def test_a_snapshot_without_a_shadow_does_not_walk_the_model(
    dense_calls: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every stats snapshot (ten a second while sequences run, on the engine thread) reads the shadow's
    bytes: with none made, that costs no walk over the model's modules."""
    model = _llama(tmp_path)
    dense_shadow.configure(model, "off", 0)
    engine = Engine(model, eos_token_ids=(), vocab_size=256)

    def walked(m: nn.Module) -> list[nn.QuantizedLinear]:
        raise AssertionError("the snapshot walked the model's modules")

    monkeypatch.setattr(dense_shadow, "modules", walked)
    unused: Any = {}
    assert engine_snapshot(engine, unused, unused, unused)["dense_shadow_bytes"] == 0


def test_auto_stays_off_with_too_little_memory_and_says_why(
    dense_calls: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _calibrating()
    model = nn.Sequential(_q(256, 64), _q(256, 64, bits=8))
    need = dense_shadow.shadow_bytes(model)
    assert need == 2 * 256 * 64 * 2
    gib, kv = 2**30, 2**20
    kept = need + kv + int(dense_shadow.MARGIN_SHARE * gib)  # what auto keeps free
    monkeypatch.setattr(dense_shadow, "device_memory", lambda: (gib, gib - kept + 1))  # a byte short
    with caplog.at_level(logging.INFO, logger="mlx_batchd"):
        choice = dense_shadow.configure(model, "auto", kv)
    assert not choice.on and dense_shadow.resident_bytes(model) == 0
    assert "too little memory" in choice.reason
    assert [r.getMessage() for r in caplog.records if "dense shadow" in r.getMessage()] == [
        f"dense shadow: {choice.line()}"
    ]
    monkeypatch.setattr(dense_shadow, "device_memory", lambda: (gib, gib - kept))  # just enough
    choice = dense_shadow.configure(model, "auto", kv)
    assert choice.on and dense_shadow.resident_bytes(model) == need
    with pytest.raises(ValueError, match="--dense-shadow must be one of"):
        dense_shadow.decide(model, "sometimes", 0)
    fastpath.set_active(fastpath.GENERIC)  # no plans: nothing would route through it
    choice = dense_shadow.configure(model, "auto", kv)
    assert not choice.on and "plans no row counts" in choice.reason and dense_shadow.resident_bytes(model) == 0
    assert dense_shadow.configure(model, "on", kv).on  # asked for: made all the same


def test_stored_plans_name_the_shadow_only_when_timed_with_it(dense_calls: list[int], tmp_path: Path) -> None:
    shapes = [QUANTIZED]
    large = fastpath.LARGE_ROWS
    plans = {QUANTIZED: {**{r: r for r in range(2, 16)}, 16: DENSE, **dict.fromkeys(large, DENSE)}}
    got, stored = plan_store.load_or_time(tmp_path, shapes, 16, (8, 16), lambda: plans, 0, large, True)
    assert got == plans and not stored
    again, stored = plan_store.load_or_time(tmp_path, shapes, 16, (8, 16), lambda: {}, 0, large, True)
    assert again == plans and stored
    with pytest.raises(ValueError, match="planned to -100"):  # timed without the shadow
        plan_store.valid(plans, shapes, 16, (8, 16), 0, large)
    low = {QUANTIZED: {**plans[QUANTIZED], 15: DENSE}}
    with pytest.raises(ValueError, match="15 rows planned to -100"):  # below MIN_ROWS
        plan_store.valid(low, shapes, 16, (8, 16), 0, large, True)
    assert plan_store.plan_key(shapes, 16, (8, 16), large, True) != plan_store.plan_key(shapes, 16, (8, 16), large)
    # Without the shadow the same model's plans are looked up under another key: timed again.
    timed, stored = plan_store.load_or_time(tmp_path, shapes, 16, (8, 16), lambda: {}, 0, large)
    assert timed == {} and not stored


def test_the_plans_key_follows_the_shadow(dense_calls: list[int], tmp_path: Path) -> None:
    _calibrating()
    model = _llama(tmp_path)
    off = plan_units.shapes_of(model)
    dense_shadow.configure(model, "on", 0)
    on = plan_units.shapes_of(model)
    assert off is not None and on is not None
    assert not off.dense and off.large == () and on.dense and on.large == fastpath.LARGE_ROWS
    dense_shadow.configure(model, "off", 0)
    again = plan_units.shapes_of(model)
    assert again is not None and not again.dense
    # The shadow compiles nothing and checks nothing: no warm-up forward for its row counts.
    assert plan_units.warm_rows(model, {"s": {16: DENSE, 32: fastpath.MMA, 64: DENSE}}) == [32]


def test_a_large_row_count_takes_the_shadow_of_the_next_one_up() -> None:
    plan = {2: 2, 16: DENSE, 32: 32, 64: DENSE}
    assert fastpath.lookup(plan, 16) == DENSE
    assert fastpath.lookup(plan, 20) == 20 and fastpath.lookup(plan, 40) == DENSE and fastpath.lookup(plan, 99) == DENSE
    assert fastpath.tile(DENSE) is None  # not a w4a16 tile


def test_auto_at_start_up_leaves_the_kv_budget_or_max_batch_s_kv_free(
    dense_calls: list[int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The engine's start-up (``configure_dense_shadow``) asks ``auto`` to keep free ``--kv-budget-mb``,
    or without one ``RESERVE_TOKENS`` of KV for each of ``max_batch`` sequences."""
    from workers.api import EngineSettings
    from workers.engine.startup import configure_dense_shadow, shadow_line
    from workers.models.loading import load

    loaded = load(str(write_model(tmp_path / "q4", llama_config(quant_bits=4), seed=3)))
    reserves: list[int] = []
    real = dense_shadow.decide

    def seen(model: nn.Module, mode: str, reserve_bytes: int) -> dense_shadow.Choice:
        reserves.append(reserve_bytes)
        return real(model, mode, reserve_bytes)

    monkeypatch.setattr(dense_shadow, "decide", seen)
    _calibrating()
    configure_dense_shadow(loaded, EngineSettings(dense_shadow="auto", kv_budget_bytes=3 * 2**20))
    configure_dense_shadow(loaded, EngineSettings(dense_shadow="auto", max_batch=5))
    per_sequence = min(dense_shadow.RESERVE_TOKENS, loaded.info.context_length) * loaded.info.kv_bytes_per_token
    assert reserves == [3 * 2**20, 5 * per_sequence]
    monkeypatch.setattr(dense_shadow, "device_memory", lambda: (2**30, 2**30 - 2**20))  # a MiB free
    configure_dense_shadow(loaded, EngineSettings(dense_shadow="auto"))
    assert shadow_line(loaded).startswith("off (--dense-shadow auto: too little memory: ")
