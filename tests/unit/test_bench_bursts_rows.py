"""``mlx-batchd bench-bursts``'s B = 1 rows from given figures: a drafter whose bursts did not run is
reported as declined, never as a speedup, and every figure has its spread."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.bench import bursts

CLASSIC = [100.0, 90.0, 110.0]
RAN = {"rounds": 10, "drafted": 40, "accepted": 30, "emitted": 40}


@pytest.mark.parametrize(
    ("verdict", "counts", "status"),
    [
        ({"level": None, "exact": False}, dict.fromkeys(RAN, 0), "declined: verdict"),
        ({"level": "wide", "exact": True}, dict.fromkeys(RAN, 0), "declined: no burst round ran"),
        ({}, RAN, "declined: verdict"),
    ],
)
def test_a_declined_drafter_is_never_a_speedup(verdict: dict[str, Any], counts: dict[str, int], status: str) -> None:
    row = bursts.b1_row("pl", [150.0, 140.0, 160.0], CLASSIC, verdict, counts, 0.01)
    assert row["status"] == status and row["speedup"] is None and row["round_cost_steps"] is None
    assert row["vs_classic"] == 1.5 and row["vs_classic_spread"] == pytest.approx([140 / 110, 160 / 90])
    ran = bursts.b1_row("pl", [150.0, 140.0, 160.0], CLASSIC, {"level": "wide", "exact": True}, RAN, 0.01)
    assert ran["status"] == "bursts" and ran["speedup"] == 1.5 and ran["round_cost_steps"] == pytest.approx(1.0)
    assert (ran["acceptance"], ran["tokens_per_round"], ran["level"]) == (0.75, 4.0, "wide")
