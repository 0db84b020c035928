"""Timing the ways to run projections: chained calls, and the check on whole decode forwards.

The timings themselves are the device's; where a test needs one way to be the cheapest, the timer is
replaced by a stand-in (named as such) and the test checks what is chosen and installed from it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.helpers.fastpath import policy as policy
from workers.kernels import fastpath, plan_store, plan_timing, plan_units
from workers.models.loading import load

pytestmark = pytest.mark.usefixtures("policy")


def test_each_timed_call_waits_for_the_previous_ones_output() -> None:
    """Independent calls may run side by side on a GPU and time how many finish together; chained,
    each call's input holds the previous output (a NaN there reaches the next call)."""
    seen: list[mx.array] = []

    def way(x: mx.array) -> mx.array:
        seen.append(x)
        return mx.full((x.shape[0], 3), math.nan if len(seen) == 1 else 0.0)

    mx.eval(plan_timing._chain(way, mx.zeros((2, 4)), 3))
    assert not bool(mx.any(mx.isnan(seen[0])).item())
    assert bool(mx.all(mx.isnan(seen[1])).item()) and bool(mx.all(mx.isnan(seen[2])).item())


def test_every_way_computes_the_projection_on_the_real_rows() -> None:
    """As called, flattened and padded, the timed ways return the call's own rows (what is timed is
    the projection itself, not a different amount of work)."""
    lin = nn.Linear(8, 5)
    original = type(lin).__call__
    x = mx.random.normal((3, 8))
    want = lin(x)
    for to in (0, 3, 8, 16):
        out = plan_timing._way(original, lin, to)(x)
        assert out.shape == (3, 5) and bool(mx.allclose(out, want).item()), to


def _tiny(tmp_path: Path) -> nn.Module:
    from workers.models.synthetic import llama_config, write_model

    return load(str(write_model(tmp_path / "m", llama_config(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2)))).model


def test_the_forward_check_keeps_a_clearly_cheaper_uniform_way_and_installs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per row count the decode forward under each candidate is timed: a uniform way that beats the
    per-shape plans by more than the margin replaces them on every shape (and is what the model's
    projections then run); a near tie keeps the plans."""
    model = _tiny(tmp_path)
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=4))

    def stand_in(m: Any, rows: int, installs: list[Any]) -> list[float]:
        """Stand-in forward timings: at 3 rows padding to 16 is clearly cheaper, at 4 rows as called
        is within the margin, elsewhere the plans win."""
        names = [n for n, _ in plan_timing.candidates(plans, set(), rows)]
        costs = dict.fromkeys(names, 1.0)
        if rows == 3:
            costs["padded to 16"] = 0.5
        if rows == 4:
            costs["as called"] = 0.99
        return [costs[n] for n in names]

    monkeypatch.setattr(plan_timing, "forward_ms", stand_in)
    monkeypatch.setattr(plan_timing, "_ms", lambda calls, x: [1.0] * len(calls))  # per shape: flattened
    plans = {shape: plan_timing.time_plan(m, 4) for m, shape in reversed(fastpath._projections(model))}
    report: dict[int, dict[str, Any]] = {}
    checked = plan_timing.forward_checked(model, plans, set(), 4, report)
    assert all(plan == {2: 2, 3: 16, 4: 4} for plan in checked.values())
    assert report[3]["kept"] == "padded to 16" and report[4]["kept"] == "plans" and report[2]["kept"] == "plans"
    assert set(report[2]["ms"]) == {"plans", "as called", "padded to 8", "padded to 16"}  # flattened == plans
    for m, shape in fastpath._projections(model):
        assert fastpath._plans[id(m)] is checked[shape]
    assert plan_store.valid(checked, sorted(checked), 4, fastpath.PADS) == checked


def test_calibration_times_real_decode_forwards_under_each_candidate(tmp_path: Path) -> None:
    """Unstubbed, on this CPU: every row count's candidates are timed on the model's forward, each
    kept way is one of them, and the plans installed are valid ones."""
    model = _tiny(tmp_path)
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=3))
    report: dict[int, dict[str, Any]] = {}
    plans = plan_units.calibrate(model, report=report)
    assert sorted(report) == [2, 3]
    for row in report.values():
        assert row["kept"] in row["ms"] and all(ms > 0 for ms in row["ms"].values())
    assert plan_store.valid(plans, sorted(plans), 3, fastpath.PADS) == plans
    assert fastpath.installed(model) == fastpath.plans_summary(plans)


def test_forward_timing_installs_each_candidate_before_its_forwards(tmp_path: Path) -> None:
    model = _tiny(tmp_path)
    order: list[int] = []
    costs = plan_timing.forward_ms(model, 2, [lambda: order.append(0), lambda: order.append(1)])
    assert len(costs) == 2 and all(c > 0 for c in costs)
    assert order == [0, 1] + [0, 1] * plan_timing.FORWARD_ROUNDS


def test_forward_timing_steps_as_the_engine_does(tmp_path: Path) -> None:
    """A timed chain is decode: each forward gets the previous forward's greedy token and the next
    cache position, and every chain starts again from the same context (the cache cut back)."""
    inner = _tiny(tmp_path)
    calls: list[tuple[list[list[int]], int, mx.array]] = []

    class Recorded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.layers = inner.layers  # what make_prompt_cache reads

        def __call__(self, tokens: mx.array, cache: Any = None) -> mx.array:
            offset = cache[0].offset
            out = self.inner(tokens, cache=cache)
            calls.append((tokens.tolist(), offset, out))
            return out

    plan_timing.forward_ms(Recorded(), 2, [lambda: None])
    steps, rounds = plan_timing.FORWARD_STEPS, plan_timing.FORWARD_ROUNDS
    decode = calls[1:]  # the context's prefill first
    assert len(decode) == 1 + rounds * steps  # one untimed step, then the timed chains
    for r in range(rounds):
        chain = decode[1 + r * steps : 1 + (r + 1) * steps]
        assert [offset for _, offset, _ in chain] == [plan_timing.FORWARD_CONTEXT + i for i in range(steps)]
        assert chain[0][0] == [[0], [0]]
        for (_, _, logits), (fed, _, _) in zip(chain, chain[1:], strict=False):
            assert fed == mx.argmax(logits[:, -1:, :], axis=-1).tolist()


def test_only_a_model_that_decodes_gets_the_forward_check() -> None:
    assert not plan_timing.decodes(nn.Sequential(nn.Linear(4, 4)))


def test_a_forward_check_that_fails_keeps_the_per_shape_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Calibration runs at engine start: a model whose forward the check cannot run (here a stand-in
    failure) is served with the per-shape plans, never refused."""
    model = _tiny(tmp_path)
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=3))
    monkeypatch.setattr(plan_timing, "_ms", lambda calls, x: [1.0] * len(calls))  # per shape: flattened

    def fails(*_: Any) -> list[float]:
        raise RuntimeError("stand-in: this forward cannot run here")

    monkeypatch.setattr(plan_timing, "forward_ms", fails)
    plans = plan_units.calibrate(model)
    assert all(plan == {2: 2, 3: 3} for plan in plans.values())
    assert fastpath.installed(model) == fastpath.plans_summary(plans)
    assert "whole-forward check failed" in caplog.text
