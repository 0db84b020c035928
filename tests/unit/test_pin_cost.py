"""What a process-wide pin would cost batched decode, as the stats report it from the verdict's rows
(``workers.exact.pin_cost``): the level a pin would run at, and the decode seconds scoping saved."""

from __future__ import annotations

import pytest

from workers.exact.pin_cost import BATCH_BUCKETS, PinCost, bucket, pinning_rungs, summary


def _rows(level: str, ratios: dict[int, float]) -> list[PinCost]:
    return [PinCost(level, b, 0.01, 0.01 * r, r) for b, r in ratios.items()]


def test_a_step_counts_at_the_nearest_bucket() -> None:
    assert BATCH_BUCKETS == (1, 8, 32, 128)
    assert [bucket(b) for b in (1, 2, 4, 5, 8, 20, 21, 80, 81, 500)] == [1, 1, 1, 8, 8, 8, 32, 32, 128, 128]


def test_only_the_rungs_that_pin_are_measured() -> None:
    rungs = ["wide", "padded", "narrow", "per-query", "per-query-1"]
    assert [lv.value for lv in pinning_rungs(rungs, ["per-query"])] == ["padded", "narrow", "per-query-1"]
    assert pinning_rungs(["wide"], []) == []


def test_scoping_saved_each_buckets_seconds_times_its_ratio_at_the_pins_level() -> None:
    rows = _rows("narrow", {1: 1.5, 8: 2.0}) + _rows("per-query", {1: 3.0, 8: 5.0})
    seconds = {1: 10.0, 8: 4.0, 32: 1.0}  # 32 counts at 8, the nearest bucket measured
    wide = summary(rows, "wide", seconds, process_wide=False)
    assert wide["level"] == "narrow"  # the verdict does not pin: the first rung measured
    assert wide["estimated_seconds_saved_by_scoping"] == pytest.approx(0.5 * 10 + 1.0 * 4 + 1.0 * 1)
    assert [(r["level"], r["batch"], r["ratio"]) for r in wide["rows"]] == [
        ("narrow", 1, 1.5), ("narrow", 8, 2.0), ("per-query", 1, 3.0), ("per-query", 8, 5.0),
    ]  # fmt: skip
    pinned = summary(rows, "per-query", seconds, process_wide=False)
    assert pinned["level"] == "per-query"  # the verdict's own level
    assert pinned["estimated_seconds_saved_by_scoping"] == pytest.approx(2.0 * 10 + 4.0 * 4 + 4.0 * 1)
    assert summary(rows, "per-query", seconds, process_wide=True)["estimated_seconds_saved_by_scoping"] == 0.0


def test_a_ratio_under_one_is_noise_and_saves_nothing() -> None:
    got = summary(_rows("narrow", {1: 0.8, 8: 1.25}), None, {1: 10.0, 8: 4.0}, process_wide=False)
    assert got["estimated_seconds_saved_by_scoping"] == pytest.approx(0.25 * 4)


def test_nothing_measured_reports_nothing() -> None:
    assert summary([], "narrow", {1: 3.0}, process_wide=False) == {}
