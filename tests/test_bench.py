"""``mlx-batchd bench`` end to end on a tiny real model: every arm runs and the tables agree with the JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scheduler import bench
from scheduler.cli import build_parser


def test_drafter_args_map_specs_to_daemon_flags() -> None:
    assert bench.drafter_args("mtp:demo") == ["--mtp", "demo"]
    assert bench.drafter_args("mtp:/m/head") == ["--mtp", "/m/head"]
    assert bench.drafter_args("prompt-lookup") == ["--draft", "prompt-lookup"]
    assert bench.drafter_args("/models/draft") == ["--draft", "/models/draft"]


def test_b1_rows_compare_each_drafter_with_classic() -> None:
    samples = {("daemon", 1): [100.0, 90.0, 110.0], ("bursts:pl", 1): [150.0, 160.0, 140.0]}
    counts = {"bursts:pl": {"rounds": 10, "drafted_tokens": 40, "accepted_tokens": 30, "emitted_tokens": 40}}
    rows = bench.b1_rows(samples, counts, {"bursts:pl": {"level": "wide", "exact": True}})
    assert rows[0]["drafter"] == "classic (no drafter)" and rows[0]["tok_s"] == 100.0
    assert rows[1] == {
        "drafter": "pl",
        "tok_s": 150.0,
        "speedup": 1.5,
        "acceptance": 0.75,
        "tokens_per_round": 4.0,
        "verdict": "wide",
    }
    declined = bench.b1_rows(
        samples,
        {"bursts:pl": dict.fromkeys(counts["bursts:pl"], 0)},
        {"bursts:pl": {"level": None, "exact": False}},
    )
    assert declined[1]["acceptance"] is None and declined[1]["verdict"] == "declined (inexact)"


def test_bench_matrix_runs_every_arm(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    args = build_parser().parse_args(
        [
            "bench",
            "--model",
            str(tiny_model),
            "--batch-sizes",
            "1,2",
            "--tokens",
            "8",
            "--prompt-tokens",
            "8",
            "--repeats",
            "1",
            "--process-pin",
            "narrow",
            "--drafters",
            "prompt-lookup",
            "--poisson-rate",
            "20",
            "--poisson-requests",
            "4",
            "--out",
            str(out),
        ]
    )
    assert isinstance(args, argparse.Namespace)
    assert args.func(args) == 0
    names = {p.name for p in out.iterdir()}
    for stem in ("daemon_vs_raw", "b1_bursts", "poisson"):
        assert {f"{stem}.json", f"{stem}.md", f"{stem}.png"} <= names
    batched = json.loads((out / "daemon_vs_raw.json").read_text())
    assert [r["batch"] for r in batched["rows"]] == [1, 2]
    for r in batched["rows"]:
        assert r["raw_tok_s"] > 0 and r["daemon_tok_s"] > 0 and r["daemon_process_pin_tok_s"] > 0
        assert abs(r["ratio"] - r["daemon_tok_s"] / r["raw_tok_s"]) < 1e-9
    # the probe time of every probing daemon is reported (process pin and the drafter's)
    assert any(k.startswith("bursts:prompt-lookup") for k in batched["meta"]["probe_seconds"])
    assert any(k.startswith("daemon_process_pin") for k in batched["meta"]["probe_seconds"])
    codes = batched["meta"]["daemon_exit_codes"]  # every daemon shut down cleanly on SIGTERM
    assert set(codes) >= {"daemon", "daemon_process_pin", "bursts:prompt-lookup"} and set(codes.values()) == {0}
    b1 = json.loads((out / "b1_bursts.json").read_text())["rows"]
    assert [r["drafter"] for r in b1] == ["classic (no drafter)", "prompt-lookup"]
    assert b1[0]["tok_s"] == batched["rows"][0]["daemon_tok_s"]
    poisson = json.loads((out / "poisson.json").read_text())["result"]
    assert poisson["requests"] == 4 and poisson["daemon"] == "bursts:prompt-lookup"
    assert 0 < poisson["ttft_p50"] <= poisson["ttft_p99"]
    assert "| prompt-lookup |" in (out / "b1_bursts.md").read_text()
