"""``mlx-batchd bench-bursts`` on a tiny real model (in process, no daemon): every table runs with its
spreads, and each table is written as it finishes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scheduler.bench import bursts
from scheduler.cli import build_parser


def _args(model: Path, out: Path, *extra: str) -> Any:
    return build_parser().parse_args(
        [
            *("bench-bursts", "--model", str(model), "--ks", "2", "-k", "2", "--batch-sizes", "2"),
            *("--tokens", "6", "--batched-tokens", "4", "--prompt-tokens", "4", "--context", "8"),
            *("--repeats", "2", "--batched-repeats", "2", "--out", str(out), *extra),
        ]
    )


def test_bench_bursts_runs_every_table_with_spreads(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bursts"
    args = _args(tiny_model, out, "--draft", "prompt-lookup")
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len([x for x in printed if x.startswith("bench-bursts B = 1, repeat")]) == 2 * 2
    assert len([x for x in printed if x.startswith("bench-bursts B = 2, repeat")]) == 2 * 3
    assert printed[-1] == f"results in {out.resolve()}"
    report = json.loads((out / "bursts.json").read_text())
    classic, pl = report["b1"]
    assert classic["status"] == "classic" and classic["speedup"] is None
    assert pl["drafter"] == "prompt-lookup" and len(pl["tok_s_spread"]) == 2
    assert (pl["speedup"] is None) == (pl["status"] != "bursts")
    (row,) = report["batched"]
    assert row["batch"] == 2 and row["plain spread"][0] <= row["plain"] <= row["plain spread"][1]
    lo, hi = row["bursts configured / plain spread"]
    assert lo <= row["bursts configured / plain"] <= hi
    md = (out / "bursts.md").read_text()
    assert "| prompt-lookup |" in md and "| 2 |" in md and (out / "bursts.png").stat().st_size > 0
    assert report["k"] == {"prompt-lookup": 2} and "K: prompt-lookup 2;" in md


def test_bench_bursts_drafts_as_serve_does_unless_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without -k each drafter drafts what ``serve`` would give it: 7 for an MTP head, 4 for prompt
    lookup (the tables themselves are left out here: what each engine is built with is the point)."""
    seen: dict[str, int] = {}

    def b1_rows(loaded: Any, drafters: Any, ks: dict[str, int], *rest: Any) -> list[dict[str, Any]]:
        seen.update(ks)
        raise KeyboardInterrupt

    monkeypatch.setattr(bursts, "verify_costs", lambda *a: [])
    monkeypatch.setattr(bursts, "b1_rows", b1_rows)
    args = build_parser().parse_args(
        ["bench-bursts", "--model", "demo", "--mtp", "demo", "--draft", "prompt-lookup", "--out", str(tmp_path)]
    )
    assert args.func(args) == 130
    assert seen == {"prompt-lookup": 4, "mtp:demo": 7}
    told = build_parser().parse_args(
        ["bench-bursts", "--model", "demo", "--mtp", "demo", "-k", "3", "--out", str(tmp_path)]
    )
    assert told.func(told) == 130 and seen["mtp:demo"] == 3


def test_bench_bursts_keeps_the_tables_it_finished(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stopped during the batched table (as an outer timeout would) leaves the first two."""

    def stopped(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        raise KeyboardInterrupt

    monkeypatch.setattr(bursts, "batched_rows", stopped)
    out = tmp_path / "bursts"
    args = _args(tiny_model, out)
    assert args.func(args) == 130
    report = json.loads((out / "bursts.json").read_text())
    assert [r["k"] for r in report["verify_cost"]] == [2] and report["b1"][0]["status"] == "classic"
    assert "batched" not in report and "Verify block cost" in (out / "bursts.md").read_text()
    assert (out / "bursts.png").stat().st_size > 0
