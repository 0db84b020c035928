"""Kernel plans timed once per machine and kept: the next process reads them, a forged file is
never trusted, concurrent starts time once, and near-ties keep the flattened call."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Generator
from pathlib import Path
from typing import Any

import mlx.nn as nn
import pytest

from tests.helpers.fastpath import policy as policy
from tests.helpers.units import run_units
from workers.kernels import fastpath, plan_store, plan_timing, plan_units, qmv_launch, w4a16_source

SHAPES = ["Linear(32, 16)/None", "QuantizedLinear(64, 4)/4"]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.QuantizedLinear(32, 64, bits=4, group_size=32), nn.Linear(16, 32))


def test_a_second_calibration_reads_the_first_ones_plans_and_installs_them(
    tmp_path: Path, policy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=4))
    first = plan_units.calibrate(_model(), tmp_path)
    assert sorted(first) == SHAPES and len(list(tmp_path.glob("*.json"))) == 1

    def no_timing(m: nn.Module, n: int, large: object = None) -> Generator[str, None, dict[int, int]]:
        raise AssertionError("timed again although the plans were stored")
        yield ""  # a generator, as the one it replaces

    monkeypatch.setattr(plan_timing, "time_plan_steps", no_timing)
    again = _model()
    assert plan_units.calibrate(again, tmp_path) == first
    assert fastpath._plans[id(again.layers[2])] == first["Linear(32, 16)/None"]  # every module of a shape
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=5))
    with pytest.raises(AssertionError, match="timed again"):  # another row range is another key
        plan_units.calibrate(_model(), tmp_path)
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=4))
    monkeypatch.setattr(qmv_launch, "PER_WARP", {4: 1})
    with pytest.raises(AssertionError, match="timed again"):  # the kernel launched otherwise: another key
        plan_units.calibrate(_model(), tmp_path)


@pytest.mark.parametrize(
    "forged",
    [
        {
            "Linear(32, 16)/None": {"2": 2, "3": 2, "4": 4},
            "QuantizedLinear(64, 4)/4": {"2": 0, "3": 8, "4": 4},
        },  # 3 -> 2 rows
        {
            "Linear(32, 16)/None": {"2": 2, "3": 3, "4": 4},
            "QuantizedLinear(64, 4)/4": {"2": 0, "3": 9, "4": 4},
        },  # no pad 9
        {
            "Linear(32, 16)/None": {"2": 2, "3": 3},
            "QuantizedLinear(64, 4)/4": {"2": 0, "3": 8, "4": 4},
        },  # a row missing
        {"Linear(32, 16)/None": {"2": 2, "3": 3, "4": 4}},  # a shape missing
        ["not", "plans"],
    ],
)
def test_a_forged_or_damaged_plan_file_is_timed_again_and_rewritten(
    tmp_path: Path, forged: object, caplog: pytest.LogCaptureFixture
) -> None:
    timed = {"Linear(32, 16)/None": {2: 2, 3: 8, 4: 4}, "QuantizedLinear(64, 4)/4": {2: 0, 3: 3, 4: 16}}
    path = tmp_path / f"{plan_store.plan_key(SHAPES, 4, (8, 16))}.json"
    path.write_text(json.dumps(forged))
    plans, stored = plan_store.load_or_time(tmp_path, SHAPES, 4, (8, 16), lambda: timed)
    assert (plans, stored) == (timed, False) and "ignoring the stored kernel plans" in caplog.text
    assert plan_store.load_or_time(tmp_path, SHAPES, 4, (8, 16), lambda: {}) == (timed, True)


def test_processes_starting_together_time_the_plans_once(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import json, sys, time
        from pathlib import Path
        from workers.kernels import plan_store
        def time_plans():
            with open({str(tmp_path / "timings")!r}, "a") as f:
                f.write(sys.argv[1] + "\\n")
            time.sleep(1.0)
            return {{"Linear(8, 8)/None": {{2: int(sys.argv[1]) % 2 * 6 + 2}}}}
        plans, stored = plan_store.load_or_time(Path({str(tmp_path / "store")!r}), ["Linear(8, 8)/None"], 2, (8,), time_plans)
        print(json.dumps([plans, stored]))
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(i)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2]
        )
        for i in range(3)
    ]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert len((tmp_path / "timings").read_text().split()) == 1
    assert len({json.dumps(plans) for plans, _ in outs}) == 1
    assert sorted(stored for _, stored in outs) == [False, True, True]


def test_a_near_tie_keeps_the_flattened_call_and_a_clear_win_is_planned(
    policy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Costs per way, in the order time_plan asks for them: as called (0), flattened (rows), pads.
    costs = {2: [0.99, 1.0, 0.5, 0.6], 3: [0.985, 1.0, 0.99, 0.991], 4: [1.0, 1.0, 1.0, 1.0]}

    def fake_ms(calls: list[object], *_: object) -> list[float]:
        rows = 2 + fake_ms.calls  # type: ignore[attr-defined]
        fake_ms.calls += 1  # type: ignore[attr-defined]
        return costs[rows][: len(calls)]

    fake_ms.calls = 0  # type: ignore[attr-defined]
    monkeypatch.setattr(plan_timing, "_ms", fake_ms)
    assert plan_timing.time_plan(nn.Linear(8, 8), 4) == {2: 8, 3: 3, 4: 4}


def test_a_plans_timing_runs_each_ways_first_call_in_a_unit_of_its_own(
    policy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A calibration unit holds at most one way's first call on a row count (where a kernel compiles
    on a fresh machine, seconds each), and a row count's timing is a unit of its own after them."""
    calls: list[tuple[int, int]] = []
    real_way = plan_timing._way

    def way(f: Any, m: nn.Module, to: int) -> Any:
        inner = real_way(f, m, to)

        def call(x: Any) -> Any:
            calls.append((x.shape[0], to))
            return inner(x)

        return call

    monkeypatch.setattr(plan_timing, "_way", way)
    monkeypatch.setattr(plan_timing, "_ms", lambda ways, x: [1.0] * len(ways))
    after: list[int] = []
    labels, plan = run_units(plan_timing.time_plan_steps(nn.Linear(8, 8), 4), lambda: after.append(len(calls)))
    per_unit = [b - a for a, b in zip([0, *after], after)]
    assert per_unit == [0 if label.endswith("timed") else 1 for label in labels]
    assert [label for label in labels if label.endswith("timed")] == ["2 rows timed", "3 rows timed", "4 rows timed"]
    assert sorted(set(calls)) == sorted(calls)  # each way once, in its own unit
    assert plan == plan_timing.time_plan(nn.Linear(8, 8), 4) == {2: 2, 3: 3, 4: 4}


def test_a_lock_held_elsewhere_delays_start_up_a_bounded_time_then_plans_are_timed_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import fcntl

    monkeypatch.setattr(plan_store, "LOCK_WAIT_S", 0.3)
    with (tmp_path / "plans.lock").open("a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)  # another process stuck while holding the lock
        plans, stored = plan_store.load_or_time(tmp_path, SHAPES[:1], 2, (8,), lambda: {SHAPES[0]: {2: 8}})
    assert (plans, stored) == ({SHAPES[0]: {2: 8}}, False) and "stayed locked" in caplog.text
    assert not list(tmp_path.glob("*.json"))  # nothing written without the lock


def test_an_oversized_plan_file_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / f"{plan_store.plan_key(SHAPES[:1], 2, (8,))}.json"
    path.write_text(json.dumps({SHAPES[0]: {"2": 2}}) + " " * plan_store.MAX_FILE_BYTES)
    plans, stored = plan_store.load_or_time(tmp_path, SHAPES[:1], 2, (8,), lambda: {SHAPES[0]: {2: 8}})
    assert (plans, stored) == ({SHAPES[0]: {2: 8}}, False) and "more than plans take" in caplog.text


def test_a_cache_folder_that_cannot_be_made_still_lets_the_engine_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's $MLX_BATCHD_CACHE pointing at a file: the plans are timed here, with a warning."""
    root = tmp_path / "not-a-folder"
    root.write_text("")
    plans, stored = plan_store.load_or_time(root, SHAPES[:1], 2, (8,), lambda: {SHAPES[0]: {2: 8}})
    assert (plans, stored) == ({SHAPES[0]: {2: 8}}, False) and "cannot use" in caplog.text


def test_the_kernels_launch_settings_by_row_count_name_the_plans_they_were_timed_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fewer outputs per warp and smaller blocks at the row counts measured for them, the defaults
    elsewhere; and the kernel's variant line, which kernel plans are stored under, changes with them."""
    assert [qmv_launch.per_warp(r) for r in (1, 4, 8)] == [2, qmv_launch.OUTS_PER_WARP, 2]
    assert [qmv_launch.warps(r) for r in (1, 5, 8)] == [4, qmv_launch.WARPS, 4]
    before = qmv_launch.variant()
    monkeypatch.setattr(qmv_launch, "BLOCK_WARPS", {**qmv_launch.BLOCK_WARPS, 3: 16})
    assert qmv_launch.warps(3) == 16 and qmv_launch.variant() != before
    before = qmv_launch.variant()
    monkeypatch.setattr(qmv_launch, "AHEAD", {**qmv_launch.AHEAD, 1: 8})
    assert (qmv_launch.unroll(1), qmv_launch.unroll(2)) == (8, qmv_launch.UNROLL) and qmv_launch.variant() != before


def test_the_w4a16_variant_line_changes_with_its_tiles_and_the_rows_they_are_timed_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plans stored before the tiles, the row count they are timed from or the register caps moved are
    timed again."""
    before = w4a16_source.variant()
    monkeypatch.setattr(w4a16_source, "TILE_ROWS", w4a16_source.TILE_ROWS * 2)
    assert w4a16_source.variant() != before
    monkeypatch.undo()
    assert w4a16_source.variant() == before
    monkeypatch.setattr(w4a16_source, "TILES", w4a16_source.TILES[:-1])
    assert w4a16_source.variant() != before
    monkeypatch.undo()
    monkeypatch.setitem(w4a16_source.REGISTER_CAPS, (4, 2, 4), 128)
    assert w4a16_source.variant() != before
