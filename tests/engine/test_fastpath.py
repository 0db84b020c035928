"""The batched kernel path on real modules: projections on flattened rows, padding bands, calibrated
plans, and greedy tokens through the engine unchanged under every policy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.helpers.fastpath import greedy_tokens
from tests.helpers.fastpath import policy as policy
from workers import kernels
from workers.engine.engine import Engine
from workers.kernels import fastpath, plan_timing, plan_units


def test_project_flattens_batched_rows_and_leaves_one_row_alone(policy: None) -> None:
    fastpath.set_active(fastpath.GENERIC)
    seen: list[tuple[int, ...]] = []
    lin = nn.Linear(8, 3)

    def call(x: mx.array) -> mx.array:
        seen.append(tuple(x.shape))
        return lin(x)

    x = mx.random.normal((4, 1, 8))
    out, rows = fastpath.project(call, x, 4)
    assert seen == [(4, 8)] and rows == 4 and out.shape == (4, 1, 3)
    assert bool(mx.all(kernels.bytes_view(out) == kernels.bytes_view(lin(x))).item())
    seen.clear()
    fastpath.project(call, mx.random.normal((1, 1, 8)), 1)
    assert seen == [(1, 1, 8)]  # classic B = 1 decode: exactly as mlx-lm calls it


def test_a_plan_pads_rows_or_leaves_the_call_and_returns_only_the_real_rows(
    policy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fastpath.set_active(fastpath.FastPath("padded", flatten=True))
    monkeypatch.setitem(fastpath._plans, 1234, {5: 8, 6: 0})
    seen: list[tuple[int, ...]] = []
    lin = nn.Linear(8, 5)

    def call(x: mx.array) -> mx.array:
        seen.append(tuple(x.shape))
        return lin(x)

    x = mx.random.normal((5, 1, 8))
    out, rows = fastpath.project(call, x, 5, key=1234)
    assert seen == [(8, 8)] and rows == 8 and out.shape == (5, 1, 5)
    assert bool(mx.all(kernels.bytes_view(out) == kernels.bytes_view(lin(x))).item())  # rows exact on CPU
    seen.clear()
    fastpath.project(call, mx.random.normal((6, 1, 8)), 6, key=1234)
    assert seen == [(6, 1, 8)]  # planned "as called"
    seen.clear()
    fastpath.project(call, mx.random.normal((7, 1, 8)), 7, key=1234)
    assert seen == [(7, 8)]  # not planned: flattened


def test_calibrate_plans_every_projection_from_the_allowed_ways(policy: None) -> None:
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=4))
    model = nn.Sequential(nn.Linear(16, 32), nn.QuantizedLinear(32, 64, bits=4, group_size=32))
    plans = plan_units.calibrate(model)
    assert len(plans) == 2
    for plan in plans.values():
        assert set(plan) == {2, 3, 4}
        assert all(to == 0 or to >= rows for rows, to in plan.items())
        assert all(to in (0, rows, 8, 16) for rows, to in plan.items())
    assert fastpath._plans[id(model.layers[0])] is plans["Linear(32, 16)/None"]
    summary = fastpath.plans_summary(plans)
    assert summary.keys() == plans.keys()
    for shape, line in summary.items():
        assert line == " ".join(f"{rows}:{plans[shape][rows]}" for rows in (2, 3, 4))


def test_an_engine_reports_the_plans_its_calibration_chose(tiny_model: Path, policy: None) -> None:
    from workers.engine.stats import engine_snapshot
    from workers.models.loading import load

    loaded = load(str(tiny_model))
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=3))
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size)
    plans = engine.kernel_plans
    assert plans and all(line.startswith("2:") and " 3:" in line for line in plans.values())
    unused: Any = {}
    assert engine_snapshot(engine, unused, unused, unused)["kernel_plans"] == plans
    fastpath.set_active(fastpath.GENERIC)  # a policy that does not calibrate: nothing to report
    assert Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size).kernel_plans == {}


@pytest.mark.parametrize("name", ["off", "generic", "cuda"])
def test_batched_greedy_tokens_are_the_same_under_every_policy(tiny_model: Path, name: str, policy: None) -> None:
    """On the CPU every kernel is row-exact, so the policy may change speed but never a token: this pins
    the reshape/slice plumbing (a wrong row order or a pad row leaking into the output changes tokens)."""
    from workers.models.loading import load

    loaded = load(str(tiny_model))
    prompts = [[(7 * i + j) % 200 + 4 for j in range(6 + i)] for i in range(9)]

    def run() -> dict[int, list[int]]:
        engine = Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size, max_batch=16)
        return greedy_tokens(engine, prompts, 12)

    fastpath.set_active(fastpath.OFF)
    with kernels.stock():
        reference = run()
    fastpath.set_active({"off": fastpath.OFF, "generic": fastpath.GENERIC, "cuda": fastpath.CUDA}[name])
    if name == "cuda":  # a plan that pads some row counts and leaves others as called
        for _, m in loaded.model.named_modules():
            if isinstance(m, nn.Linear | nn.QuantizedLinear):
                fastpath._plans[id(m)] = {2: 0, 3: 8, 5: 16, 9: 16}
    try:
        assert run() == reference
    finally:
        fastpath._plans.clear()


def test_projections_on_one_input_pad_it_once_and_each_keeps_its_own_rows(
    policy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v (and gate/up) take one input one after another: padded once for all of them; another
    input (or another pad size) is padded afresh, and every output is its own call's real rows."""
    fastpath.set_active(fastpath.FastPath("padded", flatten=True))
    lins = [nn.Linear(8, n) for n in (5, 3, 3)]
    for i in range(len(lins)):
        monkeypatch.setitem(fastpath._plans, 100 + i, {4: 16, 3: 8})
    pads: list[int] = []
    real_pad = fastpath._pad
    monkeypatch.setattr(fastpath, "_pad", lambda flat, to: pads.append(to) or real_pad(flat, to))
    x = mx.random.normal((4, 1, 8))
    outs = [fastpath.project(lin, x, 4, key=100 + i)[0] for i, lin in enumerate(lins)]
    assert pads == [16]
    for lin, out in zip(lins, outs, strict=True):
        assert bool(mx.all(kernels.bytes_view(out) == kernels.bytes_view(lin(x))).item())
    fastpath.project(lins[0], mx.random.normal((4, 1, 8)), 4, key=100)
    fastpath.project(lins[0], mx.random.normal((3, 1, 8)), 3, key=100)
    assert pads == [16, 16, 8]


def test_calibration_times_a_padded_way_with_its_padding(policy: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The padding and the slice cost a step as much as a small projection: a padded way is timed
    with them, as ``project`` runs it, not on an input padded beforehand."""
    pads: list[int] = []
    real_pad = fastpath._pad
    monkeypatch.setattr(fastpath, "_pad", lambda flat, to: pads.append(to) or real_pad(flat, to))
    plan_timing.time_plan(nn.Linear(8, 8), 2)
    assert set(pads) == {8, 16}


def test_a_verdicts_pairing_names_how_attention_runs(
    tiny_model: Path, tmp_path: Path, policy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLX's cuDNN attention and the contiguous K/V copies decide which attention kernel classic
    decode and the verify run, so a verdict measured with one is not the verdict for another."""
    from workers.exact.setup import probe_setup
    from workers.exact.verdict_store import pairing_fingerprint
    from workers.kernels.backend import CUDNN_ATTENTION_ENV
    from workers.models.loading import load

    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    loaded = load(str(tiny_model))
    fastpath.set_active(fastpath.CUDA)
    monkeypatch.setenv(CUDNN_ATTENTION_ENV, "0")
    base = pairing_fingerprint(probe_setup(loaded, "none", store=False).pairing)
    monkeypatch.setenv(CUDNN_ATTENTION_ENV, "1")
    cudnn = pairing_fingerprint(probe_setup(loaded, "none", store=False).pairing)
    monkeypatch.setenv(CUDNN_ATTENTION_ENV, "0")
    fastpath.set_active(replace(fastpath.CUDA, contiguous_kv=False))
    copies = pairing_fingerprint(probe_setup(loaded, "none", store=False).pairing)
    assert len({base, cudnn, copies}) == 3
