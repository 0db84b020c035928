"""Batched forwards through the project's multi-row kernel (``fastpath.KERNEL``, ``qmv_rows``).

The CUDA kernel cannot run on this CPU: its launch is replaced by a stand-in (named as such) that
returns MLX's own one-row results, or one rounding step off them; the policy is the CUDA one, forced.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.helpers.fastpath import greedy_tokens
from tests.helpers.fastpath import policy as policy
from tests.helpers.mirrored import one_row_launch
from tests.reference import load_measured
from workers.engine.engine import Engine
from workers.kernels import fastpath, plan_store, plan_timing, plan_units, projections, qmv_rows
from workers.models.synthetic import llama_config, write_model

pytestmark = pytest.mark.usefixtures("clean_kernel_state", "policy")


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Stand-in for the CUDA launch: MLX's own one-row call per row; returns the rows of each launch."""
    monkeypatch.setattr(qmv_rows, "_matches_mlx", {})
    monkeypatch.setattr(qmv_rows, "_ready", {})
    monkeypatch.setattr(qmv_rows, "_compiled", None)
    monkeypatch.setattr(qmv_rows.rowkernel, "implementation", lambda: "cuda")
    monkeypatch.setattr(fastpath, "_plans", {})
    monkeypatch.setattr(fastpath, "one_row", set())
    launches: list[int] = []
    monkeypatch.setattr(qmv_rows, "_launch", one_row_launch(lambda x, mats: launches.append(x.shape[0])))
    return launches


def _kernel_cheapest(calls: list[Any], *_: Any) -> list[float]:
    """Timings in which the last way asked for (the kernel, where offered) is the cheapest."""
    return [1.0] * (len(calls) - 1) + [0.5]


def _plans_kept(model: Any, rows: int, installs: list[Any]) -> list[float]:
    """Forward timings in which the per-shape plans (the first candidate) are the cheapest."""
    return [0.5] + [1.0] * (len(installs) - 1)


@pytest.fixture
def kernel_cheapest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration timings (stand-ins: the CUDA kernel cannot run here) that plan the kernel wherever
    it takes a shape, and a forward check that keeps those plans."""
    monkeypatch.setattr(plan_timing, "_ms", _kernel_cheapest)
    monkeypatch.setattr(plan_timing, "forward_ms", _plans_kept)


def _model(tmp_path: Path) -> nn.Module:
    return load_measured(write_model(tmp_path / "q4", llama_config(quant_bits=4), seed=3))


def _greedy(model: nn.Module, prompts: list[list[int]]) -> dict[int, list[int]]:
    return greedy_tokens(Engine(model, eos_token_ids=(), vocab_size=256, max_batch=8), prompts, 10)


def test_calibration_plans_the_kernel_where_it_is_cheapest_and_only_on_layers_it_takes(
    stand_in: list[int], kernel_cheapest: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=10))
    q = nn.QuantizedLinear(256, 64, bits=4, group_size=64)
    q.set_dtype(mx.bfloat16)
    model = nn.Sequential(nn.Linear(256, 256), q)
    plans = plan_units.calibrate(model)
    kernel_plan = plans["QuantizedLinear(64, 32)/4"]
    # One row and up to the kernel's rows: the kernel; beyond them the cheapest of MLX's ways.
    assert {r: t for r, t in kernel_plan.items() if r <= qmv_rows.MAX_ROWS} == dict.fromkeys(range(1, 9), -1)
    assert kernel_plan[9] == 16 and kernel_plan[10] == 16
    assert set(plans["Linear(256, 256)/None"]) == set(range(2, 11))  # not quantized: no kernel, no one-row plan
    assert -1 not in plans["Linear(256, 256)/None"].values()
    assert fastpath.one_row == {id(q)}
    assert fastpath.plans_summary(plans)["QuantizedLinear(64, 32)/4"].startswith("1:k 2:k ")


def test_a_kernel_that_differs_from_mlx_is_never_planned(
    stand_in: list[int], kernel_cheapest: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    off = qmv_rows._launch

    def off_by_one_step(x: mx.array, mats: list[tuple[mx.array, ...]], bits: int, gs: int) -> list[mx.array]:
        return [(o.view(mx.uint16) ^ mx.array(1, dtype=mx.uint16)).view(mx.bfloat16) for o in off(x, mats, bits, gs)]

    monkeypatch.setattr(qmv_rows, "_launch", off_by_one_step)
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=4))
    q = nn.QuantizedLinear(256, 64, bits=4, group_size=64)
    q.set_dtype(mx.bfloat16)
    plans = plan_units.calibrate(nn.Sequential(q))
    assert plans == {"QuantizedLinear(64, 32)/4": {2: 16, 3: 16, 4: 16}} and not fastpath.one_row


def test_batched_and_one_row_decode_through_the_kernel_keep_every_token(
    tmp_path: Path, stand_in: list[int], kernel_cheapest: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens of a mixed batch (prefill, batched decode, a lone sequence's last steps) with
    every quantized projection planned to the kernel at 1..8 rows are the stock engine's, and the
    kernel ran on one row and on several."""
    model = _model(tmp_path)
    prompts = [[(7 * i + j) % 200 + 4 for j in range(5 + 3 * i)] for i in range(5)]
    fastpath.set_active(fastpath.OFF)
    reference = _greedy(model, prompts)
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=8))
    plan_units.calibrate(model)
    stand_in.clear()
    assert _greedy(model, prompts) == reference
    assert 1 in stand_in and any(1 < rows <= 8 for rows in stand_in)


def test_stored_plans_may_name_the_kernel_only_up_to_its_rows() -> None:
    shapes = ["QuantizedLinear(64, 32)/4"]
    ok = {shapes[0]: {1: -1, 2: -1, 3: 8, 4: 0}}
    assert plan_store.valid(ok, shapes, 4, (8, 16), kernel_rows=8) == ok
    assert plan_store.valid({shapes[0]: {2: 2, 3: 3, 4: 4}}, shapes, 4, (8, 16), kernel_rows=8)
    for bad in ({1: 0, 2: 2, 3: 3, 4: 4}, {1: 16, 2: 2, 3: 3, 4: 4}, {2: -1, 3: 3, 4: 4}, {2: -2, 3: 3, 4: 4}):
        with pytest.raises(ValueError):
            plan_store.valid({shapes[0]: bad}, shapes, 4, (8, 16), kernel_rows=1)


def test_a_verdicts_pairing_names_the_kernel_plans_its_wide_forwards_ran_by(
    tmp_path: Path, stand_in: list[int], kernel_cheapest: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan decides which kernel a batched wide forward runs, so a verdict measured under one set of
    plans is not the verdict for another: the plans are part of the pairing's fingerprint."""
    from workers.exact.setup import probe_setup
    from workers.exact.verdict_store import pairing_fingerprint
    from workers.models.loading import load

    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    loaded = load(str(write_model(tmp_path / "q4", llama_config(quant_bits=4), seed=3)))
    before = probe_setup(loaded, "none", store=False).pairing
    assert before["kernel_plans"] == {}
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=4))
    plan_units.calibrate(loaded.model)
    after = probe_setup(loaded, "none", store=False).pairing
    assert after["kernel_plans"] == fastpath.installed(loaded.model)
    assert after["kernel_plans"] and all(line.startswith("1:k 2:k") for line in after["kernel_plans"].values())
    assert pairing_fingerprint(after) != pairing_fingerprint(before)


def test_the_kernels_shortcut_for_a_checked_layer_follows_new_weights(stand_in: list[int]) -> None:
    """Once checked, a layer's calls go straight to the launch; a layer whose weights are replaced
    (same shapes) is computed with the new ones, never with the arrays kept at its check."""
    q = nn.QuantizedLinear(256, 64, bits=4, group_size=64)
    q.set_dtype(mx.bfloat16)
    original = getattr(type(q).__call__, "__wrapped__", type(q).__call__)
    x = mx.random.normal((3, 256), key=mx.random.key(1)).astype(mx.bfloat16)
    first = qmv_rows.project(q, original, x)
    assert first is not None and (id(q),) in qmv_rows._ready
    other = nn.QuantizedLinear(256, 64, bits=4, group_size=64)
    other.set_dtype(mx.bfloat16)
    q.update({"weight": other["weight"], "scales": other["scales"], "biases": other["biases"]})
    again = qmv_rows.project(q, original, x)
    expected = mx.concatenate([original(q, x[i : i + 1]) for i in range(3)])
    assert again is not None and bool(mx.array_equal(again.view(mx.uint16), expected.view(mx.uint16)).item())
    assert not bool(mx.array_equal(first.view(mx.uint16), expected.view(mx.uint16)).item())


def test_plans_read_from_the_store_run_the_kernel_at_every_planned_row_count_at_load(
    tmp_path: Path, stand_in: list[int], kernel_cheapest: None
) -> None:
    """A process that reads its plans from the store times nothing, so the kernel's first-use check
    and compilation (seconds on a GPU) would otherwise fall inside the first request whose batch
    reaches a row count planned to the kernel. Loading runs the kernel at every such row count."""
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=8))
    store = tmp_path / "plans"
    plans = plan_units.calibrate(_model(tmp_path), store)
    planned = {r for plan in plans.values() for r, to in plan.items() if to == fastpath.KERNEL}
    assert planned == set(range(1, 9))
    # the whole-forward check that chose them is kept beside them, each row count's candidates and choice
    (check,) = store.glob("*.check.json")
    kept = json.loads(check.read_text())
    assert set(kept) == {str(r) for r in range(1, 9)} and all(r["kept"] in r["ms"] for r in kept.values())
    qmv_rows._matches_mlx.clear()  # another process: nothing checked yet
    qmv_rows._ready.clear()
    stand_in.clear()
    again = load_measured(write_model(tmp_path / "again", llama_config(quant_bits=4), seed=3))
    assert plan_units.calibrate(again, store) == plans
    assert qmv_rows._matches_mlx and all(qmv_rows._matches_mlx.values())
    assert planned <= set(stand_in)


def test_siblings_all_planned_to_the_kernel_share_one_call_in_batched_decode(
    tmp_path: Path, stand_in: list[int], kernel_cheapest: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With q/k/v and gate/up all planned to the kernel at a row count, a batched decode step makes one
    kernel call per sibling group (4 calls a layer instead of 7) and keeps every token; a group with
    one member planned otherwise makes one call per member."""
    model = _model(tmp_path)
    prompts = [[(7 * i + j) % 200 + 4 for j in range(5 + 3 * i)] for i in range(5)]
    fastpath.set_active(fastpath.OFF)
    reference = _greedy(model, prompts)
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=8))
    plans = plan_units.calibrate(model)
    widths: list[tuple[int, int]] = []  # (rows, matrices) of each launch
    monkeypatch.setattr(qmv_rows, "_launch", one_row_launch(lambda x, mats: widths.append((x.shape[0], len(mats)))))
    assert _greedy(model, prompts) == reference
    widths.clear()  # the kernel's first-use check of each shape ran in that pass: count the steps alone
    assert _greedy(model, prompts) == reference
    # at 5 rows, every layer: one call for q/k/v, one for gate/up, one each for o and down
    qkv, gate_up, alone = (widths.count((5, n)) for n in (3, 2, 1))
    assert qkv == gate_up > 0 and qkv % len(model.layers) == 0 and alone == 2 * qkv
    # the answers kept per (module, rows) stop at the kernel's rows: prefill's row counts are not kept
    assert projections._together and max(rows for _, rows in projections._together) <= qmv_rows.MAX_ROWS

    engine = Engine(model, eos_token_ids=(), vocab_size=256, max_batch=8)  # calibrates at load: plans after it
    up_shape = next(s for m, s in fastpath._projections(model) if m is model.layers[0].mlp.up_proj)
    fastpath.install(model, {**plans, up_shape: {**plans[up_shape], 5: 0}})  # up (and gate): MLX's call at 5 rows
    widths.clear()
    assert greedy_tokens(engine, prompts, 10) == reference
    assert (5, 2) not in widths and widths.count((5, 1)) == 2 * widths.count((5, 3)) > 0  # gate, up: MLX
