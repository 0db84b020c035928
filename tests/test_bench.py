"""``mlx-batchd bench`` on a tiny real model: every arm runs, the tables agree with the JSON, a drafter
whose bursts never run reads 1.00 of classic within its spread and is reported as declined, the
physical reference is right, and the tables are written as each batch size finishes."""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import workers.seam
from scheduler.bench.arms import HTTP_ARMS, drafter_args, http_generate, run_engine
from scheduler.bench.b1 import b1_markdown, b1_rows
from scheduler.bench.batched import Setup, batched_markdown, batched_rows
from scheduler.bench.matrix import write_tables
from scheduler.bench.prefix import PREFIX_ARMS, PrefixPlan
from scheduler.bench.prefix_report import prefix_markdown
from scheduler.bench.reference import reference_line, reference_tok_s
from scheduler.bench.spreads import ratio_spread, spread
from scheduler.cli import build_parser
from workers import kernels

CLASSIC = [100.0, 90.0, 110.0]
COUNTS = {"rounds": 10, "drafted_tokens": 40, "accepted_tokens": 30, "emitted_tokens": 40}
NO_ROUNDS = dict.fromkeys(COUNTS, 0)


def test_drafter_args_map_specs_to_daemon_flags() -> None:
    assert drafter_args("mtp:demo") == ["--mtp", "demo"]
    assert drafter_args("mtp:/m/head") == ["--mtp", "/m/head"]
    assert drafter_args("prompt-lookup") == ["--draft", "prompt-lookup"]
    assert drafter_args("/models/draft") == ["--draft", "/models/draft"]


def test_b1_rows_give_every_arm_its_median_spread_and_ratio_spread() -> None:
    samples = {("daemon", 1): CLASSIC, ("bursts:pl", 1): [150.0, 160.0, 140.0]}
    rows = b1_rows(samples, {"bursts:pl": COUNTS}, {"bursts:pl": {"level": "wide", "exact": True}})
    classic, pl = rows
    assert classic["drafter"] == "classic (no drafter)" and classic["tok_s"] == 100.0
    assert classic["tok_s_spread"] == [90.0, 110.0] and classic["status"] == "classic"
    assert classic["speedup"] is None and classic["vs_classic"] == 1.0
    assert classic["vs_classic_spread"] == pytest.approx([90 / 110, 110 / 90])
    assert pl["drafter"] == "pl" and pl["tok_s"] == 150.0 and pl["tok_s_spread"] == [140.0, 160.0]
    assert pl["status"] == "bursts" and pl["speedup"] == pl["vs_classic"] == 1.5 and pl["alike"] is None
    assert pl["vs_classic_spread"] == pytest.approx([140 / 110, 160 / 90])
    assert (pl["rounds"], pl["acceptance"], pl["tokens_per_round"], pl["verdict"]) == (10, 0.75, 4.0, "wide")
    md = b1_markdown(rows)
    assert "| pl | 150.0 | 140.0-160.0 | 1.500x | 1.273-1.778 | 10 | 0.750 | 4.00 | wide |" in md


@pytest.mark.parametrize(
    ("counts", "verdict", "status"),
    [
        (NO_ROUNDS, {"level": None, "exact": False}, "declined: verdict"),
        (NO_ROUNDS, {"level": "wide", "exact": True}, "declined: no burst round ran"),
        ({**COUNTS, "rounds": 3}, {}, "declined: verdict"),  # no verdict known: never a speedup
    ],
)
def test_a_declined_arm_is_never_reported_as_a_speedup(
    counts: dict[str, int], verdict: dict[str, object], status: str
) -> None:
    """An arm whose bursts did not run, measured faster than classic: its ratio and spread are shown,
    labelled declined, and the mismatch is flagged as arms not measured alike."""
    samples = {("daemon", 1): CLASSIC, ("bursts:pl", 1): [140.0, 150.0, 160.0]}
    declined = b1_rows(samples, {"bursts:pl": counts}, {"bursts:pl": verdict})[1]
    assert declined["status"] == status and declined["speedup"] is None
    assert declined["vs_classic"] == 1.5 and declined["alike"] is False
    md = b1_markdown(b1_rows(samples, {"bursts:pl": counts}, {"bursts:pl": verdict}))
    (line,) = [x for x in md.splitlines() if x.startswith("| pl |")]
    assert f"| {status} (ratio 1.500) | 1.273-1.778 |" in line and "x |" not in line
    assert "warning: pl decoded classically" in md and "not measured alike" in md
    same = {("daemon", 1): CLASSIC, ("bursts:pl", 1): [95.0, 105.0, 100.0]}
    alike = b1_rows(same, {"bursts:pl": counts}, {"bursts:pl": verdict})[1]
    assert alike["alike"] is True and "warning" not in b1_markdown([alike])


def test_physical_reference_row_math() -> None:
    """Weight bytes plus each sequence's KV (bytes per token x context) per step at the bandwidth."""
    weights, kv, context = 4_500_000_000, 131_072, 96
    step = weights + kv * context
    assert reference_tok_s(weights, kv, context, 1, 4800) == pytest.approx(4800e9 / step)
    assert reference_tok_s(weights, kv, context, 8, 4800) == pytest.approx(8 * 4800e9 / (weights + 8 * kv * context))
    line = reference_line(weights, kv, context, 1, 4800)
    assert line == (
        "physical limit at B = 1: 4.500 GB of weights + 12.583 MB of KV (96 tokens of context) read per step "
        f"at 4800 GB/s = {4800e9 / step:.1f} tok/s"
    )
    setup = Setup((1,), ("raw", "engine", "daemon"), ("bursts:pl",), 3, weights, kv, context, 4800.0)
    ref = setup.reference(1)
    assert ref == pytest.approx(4800e9 / step) and setup.reference_line(1) == line
    assert Setup((1,), ("daemon",), weight_bytes=weights).reference(1) is None  # no bandwidth: omitted
    samples = {("daemon", 1): CLASSIC, ("bursts:pl", 1): [150.0, 160.0, 140.0]}
    rows = b1_rows(samples, {"bursts:pl": COUNTS}, {"bursts:pl": {"level": "wide", "exact": True}}, ref)
    assert ref is not None and [r["of_limit"] for r in rows] == pytest.approx([100 / ref, 150 / ref])
    md = b1_markdown(rows, setup.reference_line(1))
    assert "tok/s / physical limit |" in md and line in md


def _samples(batches: dict[int, list[str]], repeats: int) -> dict[tuple[str, int], list[float]]:
    return {(arm, b): [100.0 * b + i for i in range(repeats)] for b, arms in batches.items() for arm in arms}


def test_tables_are_written_with_the_batch_sizes_finished_so_far(tmp_path: Path) -> None:
    """What a run killed by an outer timeout leaves: every finished B, and the B = 1 table."""
    arms = ["raw", "engine", "daemon"]
    setup = Setup((1, 4, 8), tuple(arms), ("bursts:pl",), repeats=2)
    samples = _samples({1: [*arms, "bursts:pl"]}, 2)
    samples[("raw", 4)] = [400.0, 410.0]  # B = 4 under way: not a row yet
    samples[("daemon", 4)] = [390.0]
    meta = {"model": "m", "device": "cpu"}
    counts = {"bursts:pl": NO_ROUNDS}
    verdicts = {"bursts:pl": {"level": None, "exact": False}}
    md = write_tables(samples, setup, meta, tmp_path, counts, verdicts)
    report = json.loads((tmp_path / "daemon_vs_raw.json").read_text())
    assert [r["batch"] for r in report["rows"]] == [1]
    assert report["meta"]["batches_done"] == [1] and report["meta"]["complete"] is False
    assert report["rows"][0]["daemon_spread"] == [100.0, 101.0] and report["rows"][0]["raw_spread"] == [100.0, 101.0]
    assert "| 1 |" in (tmp_path / "daemon_vs_raw.md").read_text() and "| 4 |" not in md
    b1 = json.loads((tmp_path / "b1_bursts.json").read_text())["rows"]
    assert [r["status"] for r in b1] == ["classic", "declined: verdict"]
    samples.update(_samples({4: arms, 8: arms}, 2))
    write_tables(samples, setup, meta, tmp_path, counts, verdicts)
    report = json.loads((tmp_path / "daemon_vs_raw.json").read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 4, 8] and report["meta"]["complete"] is True


def test_batched_rows_give_every_ratio_its_spread(tmp_path: Path) -> None:
    """daemon / raw, daemon / engine and process pin / scoped: ratios of medians, with the range the two
    arms' samples allow, in the JSON and the Markdown; the physical limit and KV bytes per step."""
    arms = ("raw", "engine", "daemon", "daemon_process_pin")
    weights, kv, context = 1_000_000_000, 1000, 50
    setup = Setup((4,), arms, repeats=3, weight_bytes=weights, kv_bytes_per_token=kv, context=context, gb_per_s=100.0)
    samples = {
        ("raw", 4): [100.0, 80.0, 120.0],
        ("engine", 4): [200.0, 190.0, 210.0],
        ("daemon", 4): [196.0, 180.0, 200.0],
        ("daemon_process_pin", 4): [98.0, 90.0, 100.0],
    }
    (row,) = batched_rows(samples, setup)
    assert row["ratio"] == pytest.approx(196 / 100) and row["ratio_spread"] == pytest.approx([180 / 120, 200 / 80])
    assert row["vs_engine"] == pytest.approx(196 / 200) and row["vs_engine_spread"] == pytest.approx(
        [180 / 210, 200 / 190]
    )
    assert row["process_pin_vs_scoped"] == pytest.approx(98 / 196)
    assert row["process_pin_vs_scoped_spread"] == pytest.approx([90 / 200, 100 / 180])
    assert row["kv_bytes_per_step"] == 4 * kv * context
    assert row["reference_tok_s"] == pytest.approx(reference_tok_s(weights, kv, context, 4, 100.0))
    meta = {"model": "m", "device": "cpu", "repeats": 3, "weight_bytes": weights, "bandwidth_gb_s": 100.0}
    md = write_tables(samples, setup, {**meta, "kv_bytes_per_token": kv, "context": context}, tmp_path)
    (line,) = [x for x in md.splitlines() if x.startswith("| 4 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:6] == [
        "100.0 (80.0-120.0)",
        "200.0 (190.0-210.0)",
        "196.0 (180.0-200.0)",
        f"1.960 ({180 / 120:.3f}-{200 / 80:.3f})",
        f"0.980 ({180 / 210:.3f}-{200 / 190:.3f})",
    ]
    assert cells[8:10] == [f"{row['reference_tok_s']:.0f}", "0.200"]
    assert "1.000 GB of weights read once per decode step at 100 GB/s (10.000 ms per step)" in md
    assert json.loads((tmp_path / "daemon_vs_raw.json").read_text())["rows"][0]["ratio_spread"] == row["ratio_spread"]


def test_raw_runs_only_up_to_its_max_batch_and_its_cells_read_not_run(tmp_path: Path) -> None:
    """``--raw-max-batch``: above it the raw arm is not scheduled, the row still finishes, and the
    table shows ``-`` for raw and daemon / raw instead of a figure from nowhere."""
    arms = ("raw", "engine", "daemon")
    setup = Setup((4, 8), arms, repeats=1, raw_max_batch=4)
    assert setup.arms_at(4) == ["raw", "engine", "daemon"] and setup.arms_at(8) == ["engine", "daemon"]
    samples = {("raw", 4): [100.0], ("engine", 4): [200.0], ("daemon", 4): [190.0]}
    samples.update({("engine", 8): [300.0], ("daemon", 8): [290.0]})
    rows = batched_rows(samples, setup)
    assert [r["batch"] for r in rows] == [4, 8]
    assert "ratio" not in rows[1] and "raw_tok_s" not in rows[1] and rows[1]["vs_engine"] == pytest.approx(290 / 300)
    md = write_tables(samples, setup, {"model": "m", "device": "cpu", "raw_max_batch": 4}, tmp_path)
    (line,) = [x for x in md.splitlines() if x.startswith("| 8 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "-" and cells[4] == "-" and cells[5].startswith("0.967")
    assert "measured up to B = 4 only" in md


def test_nothing_is_written_before_a_batch_size_finishes(tmp_path: Path) -> None:
    setup = Setup((1,), ("raw", "daemon"), repeats=3)
    assert write_tables(_samples({1: ["raw", "daemon"]}, 2), setup, {}, tmp_path) == ""
    assert not tmp_path.joinpath("daemon_vs_raw.json").exists()


def _perturb(out: mx.array) -> mx.array:
    """Flip the lowest mantissa bit of every element: a divergence of one ulp."""
    bits = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16, mx.float32: mx.uint32}[out.dtype]
    return (out.view(bits) ^ 1).view(out.dtype)


def store_declined_verdict(model: Path, drafter: str = "prompt-lookup") -> None:
    """Probe, in this process, exactly the pairing that ``serve --draft DRAFTER`` probes, with a
    divergence no kernel level avoids injected at the named test seam (the output head differs
    whenever it runs pinned or on several rows, while classic decode runs it on one row, wide).
    The declined verdict lands in the verdict store (``$MLX_BATCHD_CACHE``), where a daemon started
    afterwards finds it: the bench's drafter daemon then decodes classically, by construction."""
    from workers.engine import Engine
    from workers.loop import EngineSettings, configure_bursts
    from workers.models import load

    loaded = load(str(model))
    vocab = loaded.info.vocab_size
    engine = Engine(loaded.model, eos_token_ids=loaded.info.eos_token_ids, vocab_size=vocab)

    def no_level_is_exact(kind: str, out: mx.array, rows: int) -> mx.array:
        head = kind == "projection" and out.shape[-1] == vocab
        return _perturb(out) if head and (rows > 1 or kernels.current_level() is not kernels.Level.WIDE) else out

    workers.seam.divergence_seam = no_level_is_exact
    try:
        configure_bursts(engine, loaded, EngineSettings(draft=drafter))
        while engine.probing:
            engine.probe_step()
    finally:
        workers.seam.divergence_seam = None
    assert engine.pairing is not None and engine.verdicts[engine.pairing].level is None


def test_bench_matrix_runs_every_arm_and_a_declined_drafter_reads_classic(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))  # this test's declined verdict stays here
    store_declined_verdict(tiny_model)
    out = tmp_path / "bench"
    args = build_parser().parse_args(
        [
            *("bench", "--model", str(tiny_model), "--batch-sizes", "1,2", "--tokens", "8", "--prompt-tokens", "8"),
            *("--repeats", "7", "--process-pin", "narrow", "--drafters", "prompt-lookup", "--bandwidth-gbs", "100"),
            *("--poisson-rate", "20", "--poisson-requests", "4", "--out", str(out)),
        ]
    )
    assert isinstance(args, argparse.Namespace) and args.bandwidth_gbs == 100.0
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()
    measured = [x for x in printed if x.startswith("bench [")]
    assert len(measured) == 7 * (5 + 4) and measured[-1].startswith(f"bench [{7 * 9}/{7 * 9}] B = 2, repeat 7/7")
    assert printed[-1] == f"results in {out.resolve()}"
    names = {p.name for p in out.iterdir()}
    for stem in ("daemon_vs_raw", "b1_bursts", "poisson"):
        assert {f"{stem}.json", f"{stem}.md", f"{stem}.png"} <= names
    batched = json.loads((out / "daemon_vs_raw.json").read_text())
    assert [r["batch"] for r in batched["rows"]] == [1, 2] and batched["meta"]["complete"] is True
    for r in batched["rows"]:
        assert r["raw_tok_s"] > 0 and r["daemon_tok_s"] > 0 and r["daemon_process_pin_tok_s"] > 0
        assert abs(r["ratio"] - r["daemon_tok_s"] / r["raw_tok_s"]) < 1e-9
        assert r["reference_tok_s"] > 0
    # every arm ran every repeat, in an order rotated each repeat
    runs = batched["runs"]
    assert len(runs) == 7 * (5 + 4)
    firsts = {r["arm"] for r in runs if r["batch"] == 1 and r["position"] == 0}
    # each engine-driven run's step counters: at least one decode step per token after the first
    for r in runs:
        steps = r["engine_steps"]
        if r["arm"] == "raw":
            assert steps is None
        else:
            assert steps["steps"] >= steps["decode_steps"] >= r["tokens"] / r["batch"] - 1, r
            assert steps["step_seconds"] >= steps["decode_seconds"] > 0, r
    assert firsts == {"raw", "engine", "daemon", "daemon_process_pin", "bursts:prompt-lookup"}
    # the probe time of every probing daemon is reported (process pin and the drafter's)
    assert any(k.startswith("bursts:prompt-lookup") for k in batched["meta"]["probe_seconds"])
    assert any(k.startswith("daemon_process_pin") for k in batched["meta"]["probe_seconds"])
    codes = batched["meta"]["daemon_exit_codes"]  # every daemon shut down cleanly on SIGTERM
    assert set(codes) >= {"daemon", "daemon_process_pin", "bursts:prompt-lookup"} and set(codes.values()) == {0}
    b1 = json.loads((out / "b1_bursts.json").read_text())
    classic, declined = b1["rows"]
    assert [classic["drafter"], declined["drafter"]] == ["classic (no drafter)", "prompt-lookup"]
    assert classic["tok_s"] == batched["rows"][0]["daemon_tok_s"]
    # declined by construction: no round ran, and its ratio is never reported as a speedup (whether
    # its spread holds 1.00 is a measurement on a quiet machine, not something a unit test can time)
    assert declined["status"] == "declined: verdict" and declined["rounds"] == 0 and declined["speedup"] is None
    assert len(declined["vs_classic_spread"]) == 2 and isinstance(declined["alike"], bool)
    md = (out / "b1_bursts.md").read_text()
    assert "| prompt-lookup |" in md and "declined: verdict (ratio" in md and "physical limit at B = 1" in md
    poisson = json.loads((out / "poisson.json").read_text())["result"]
    assert poisson["requests"] == 4 and poisson["daemon"] == "bursts:prompt-lookup"
    assert 0 < poisson["ttft_p50"] <= poisson["ttft_p99"]


def test_bench_stopped_by_sigterm_keeps_its_finished_rows_and_stops_its_daemons(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (what an outer ``timeout`` sends) while B = 3 is under way, delivered from inside the
    engine arm so that it lands at a known point: the bench exits 143 after stopping its daemon,
    the B = 1 tables stay, and the SIGTERM handler it found is back. That handler fails the test if
    the bench left SIGTERM to it."""
    from scheduler import spawn

    started: list[spawn.DaemonProcess] = []

    class Recorded(spawn.DaemonProcess):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    engine_arm = run_engine

    def interrupted(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        if len(prompts) == 3:
            signal.raise_signal(signal.SIGTERM)
        return engine_arm(engine, prompts, max_tokens)

    monkeypatch.setattr(spawn, "DaemonProcess", Recorded)
    monkeypatch.setattr("scheduler.bench.matrix.run_engine", interrupted)
    out = tmp_path / "bench"
    args = build_parser().parse_args(
        [
            *("bench", "--model", str(tiny_model), "--batch-sizes", "1,3", "--tokens", "4", "--prompt-tokens", "4"),
            *("--repeats", "2", "--out", str(out)),
        ]
    )

    def unhandled(signum: int, frame: Any) -> None:
        raise AssertionError("the bench left SIGTERM to the handler it found")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(SystemExit) as stopped:
            args.func(args)
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert len(started) == 1 and started[0].proc.poll() is not None  # the daemon was stopped on the way out
    report = json.loads((out / "daemon_vs_raw.json").read_text())
    assert [r["batch"] for r in report["rows"]] == [1] and report["meta"]["complete"] is False
    assert {r["batch"] for r in report["runs"]} == {1}  # written when B = 1 finished, not after
    assert "incomplete run: batch sizes [1] of [1, 3]" in (out / "daemon_vs_raw.md").read_text()
    assert (out / "daemon_vs_raw.png").stat().st_size > 0
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no half-written file left


def test_http_arms_are_reported_beside_the_zeromq_arm_with_their_ratios(tmp_path: Path) -> None:
    """HTTP / ZeroMQ for whole answers and streams: ratios of medians over the daemon arm, with the
    range the two arms' samples allow, as columns of the batched table and keys of its JSON."""
    setup = Setup((16,), ("raw", "engine", "daemon", *HTTP_ARMS), repeats=3)
    samples = {
        ("raw", 16): [100.0, 90.0, 110.0],
        ("engine", 16): [200.0, 190.0, 210.0],
        ("daemon", 16): [200.0, 180.0, 220.0],
        ("http", 16): [190.0, 185.0, 195.0],
        ("http_stream", 16): [150.0, 140.0, 160.0],
    }
    (row,) = batched_rows(samples, setup)
    assert row["http_vs_zeromq"] == pytest.approx(190 / 200)
    assert row["http_vs_zeromq_spread"] == pytest.approx([185 / 220, 195 / 180])
    assert row["http_stream_vs_zeromq"] == pytest.approx(150 / 200)
    assert row["http_stream_vs_zeromq_spread"] == pytest.approx([140 / 220, 160 / 180])
    md = write_tables(samples, setup, {"model": "m", "device": "cpu", "repeats": 3}, tmp_path)
    head, _, line = md.splitlines()[:3]
    cols = [c.strip() for c in head.strip("|").split("|")]
    cells = dict(zip(cols, (c.strip() for c in line.strip("|").split("|")), strict=True))
    assert cells["daemon via HTTP tok/s"] == "190.0 (185.0-195.0)"
    assert cells["daemon via HTTP / ZeroMQ"] == f"0.950 ({185 / 220:.3f}-{195 / 180:.3f})"
    assert cells["daemon via HTTP, streamed tok/s"] == "150.0 (140.0-160.0)"
    assert cells["daemon via HTTP, streamed / ZeroMQ"] == f"0.750 ({140 / 220:.3f}-{160 / 180:.3f})"
    saved = json.loads((tmp_path / "daemon_vs_raw.json").read_text())["rows"][0]
    assert saved["http_stream_vs_zeromq_spread"] == row["http_stream_vs_zeromq_spread"]
    assert "daemon via HTTP" not in batched_markdown(batched_rows(samples, Setup((16,), ("daemon",))), {})


def test_bench_via_http_measures_the_daemon_through_its_http_door(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--via http``: the daemon arm's daemon serves HTTP too, and two more arms (whole answers, SSE
    streams) send it the ZeroMQ arm's token ids; each run is the same work as the ZeroMQ arm's (the same
    greedy tokens, counted by the daemon's engine), rotated with the other arms, and lands in the tables."""
    sent: list[tuple[bool, int]] = []
    generate = http_generate

    def recorded(http: Any, model: str, prompt: list[int], max_tokens: int, stream: bool) -> int:
        sent.append((stream, len(prompt)))
        return generate(http, model, prompt, max_tokens, stream)

    monkeypatch.setattr("scheduler.bench.arms.http_generate", recorded)
    out = tmp_path / "bench"
    args = build_parser().parse_args(
        [
            *("bench", "--model", str(tiny_model), "--batch-sizes", "1,2", "--tokens", "8", "--prompt-tokens", "6"),
            *("--repeats", "2", "--via", "http", "--out", str(out)),
        ]
    )
    assert args.via == "http"
    assert args.func(args) == 0
    measured = [x for x in capsys.readouterr().out.splitlines() if x.startswith("bench [")]
    assert len(measured) == 2 * 2 * 5 and sum(", http" in x for x in measured) == 2 * 2 * 2
    assert {s for s, _ in sent} == {False, True} and {n for _, n in sent} == {6}
    report = json.loads((out / "daemon_vs_raw.json").read_text())
    assert report["meta"]["via"] == "http" and report["meta"]["http_url"].startswith("http://127.0.0.1:")
    assert report["meta"]["daemon_exit_codes"] == {"daemon": 0}  # one daemon: both doors on it
    assert [r["batch"] for r in report["rows"]] == [1, 2] and report["meta"]["complete"] is True
    runs = report["runs"]
    for r in report["rows"]:
        for arm, key in (("http", "http_vs_zeromq"), ("http_stream", "http_stream_vs_zeromq")):
            xs = [x["tokens"] / x["seconds"] for x in runs if x["arm"] == arm and x["batch"] == r["batch"]]
            base = [x["tokens"] / x["seconds"] for x in runs if x["arm"] == "daemon" and x["batch"] == r["batch"]]
            assert r[f"{arm}_spread"] == pytest.approx(spread(xs))
            assert r[key] == pytest.approx(r[f"{arm}_tok_s"] / r["daemon_tok_s"])
            assert r[f"{key}_spread"] == pytest.approx(ratio_spread(xs, base))
    for b in (1, 2):
        for rep in range(2):
            same = {x["arm"]: x for x in runs if x["batch"] == b and x["repeat"] == rep}
            assert same["http"]["tokens"] == same["http_stream"]["tokens"] == same["daemon"]["tokens"] > 0
            for arm in HTTP_ARMS:  # the daemon's engine decoded them: one step per token after the first
                steps = same[arm]["engine_steps"]
                assert steps["decode_steps"] >= same[arm]["tokens"] / b - 1 and steps["decode_seconds"] > 0, steps
    assert {x["arm"] for x in runs if x["batch"] == 1 and x["position"] == 0} == {"raw", "engine"}
    md = (out / "daemon_vs_raw.md").read_text()
    assert "| daemon via HTTP / ZeroMQ |" in md and "| daemon via HTTP, streamed / ZeroMQ |" in md
    assert len([x for x in md.splitlines() if x.startswith(("| 1 |", "| 2 |"))]) == 2
    assert (out / "daemon_vs_raw.png").stat().st_size > 0


def test_bench_via_http_without_httpx_says_so_before_loading_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """httpx is the HTTP arms' client, not a dependency of the daemon: without it the bench says what to
    install, in one line, and loads nothing."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "httpx" else find_spec(name, *a))
    args = build_parser().parse_args(["bench", "--model", str(tmp_path / "absent"), "--via", "http"])
    assert args.func(args) == 1
    captured = capsys.readouterr()
    assert captured.err == "mlx-batchd bench: --via http needs httpx, the HTTP arms' client: pip install httpx\n"
    assert "loading" not in captured.out


PREFIX_FLAGS = (
    *("--prefix-tokens", "48", "--suffix-tokens", "8", "--warm-requests", "2", "--chat-turns", "3"),
    *("--chat-system-tokens", "24", "--chat-user-tokens", "8", "--chat-answer-tokens", "6"),
    *("--prefix-batch", "3", "--prompt-tokens", "8", "--tokens", "6", "--prefix-cache-mb", "64"),
)


def test_bench_prefix_scenario_runs_and_lands_in_the_tables(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--prefix-scenario``: warm requests are served from the cache and cold ones are not, every
    chat turn after the first reuses the previous turn's prompt, the cache-less daemon prefills every
    token and answers alike, the throughput arms hit nothing; the tables carry what the JSON holds."""
    import statistics

    out = tmp_path / "prefix"
    args = build_parser().parse_args(
        ["bench", "--prefix-scenario", "--model", str(tiny_model), *PREFIX_FLAGS, "--repeats", "2", "--out", str(out)]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()
    total = 2 * (1 + 2) + 2 * 2 + 2 * 2  # TTFT requests, a conversation and a run per daemon per repeat
    steps = [x for x in printed if x.startswith("bench prefix [")]
    assert len(steps) == total and steps[-1].startswith(f"bench prefix [{total}/{total}] B = 3, repeat 2/2")
    assert printed[-1] == f"results in {out.resolve()}"
    assert {"prefix_cache.json", "prefix_cache.md", "prefix_cache.png"} <= {p.name for p in out.iterdir()}
    assert (out / "prefix_cache.png").stat().st_size > 0
    report = json.loads((out / "prefix_cache.json").read_text())
    md = (out / "prefix_cache.md").read_text()
    meta = report["meta"]
    assert meta["complete"] is True and meta["parts_done"] == ["ttft", "chat", "throughput"]
    assert meta["prefix_cache"]["serving"] is True and meta["daemon_exit_codes"] == {"no_cache": 0, "cache": 0}
    assert "warning" not in md and "incomplete" not in md

    requests = report["ttft_requests"]
    cold = [r for r in requests if r["kind"] == "cold"]
    warm = [r for r in requests if r["kind"] == "warm"]
    assert len(cold) == 2 and len(warm) == 4
    assert {r["hit_tokens"] for r in cold} == {0} and all(r["hit_tokens"] >= 48 for r in warm)
    assert all(r["computed_tokens"] == r["prompt_tokens"] - r["hit_tokens"] for r in requests)
    t = report["ttft"]
    assert t["cold_ms"] == pytest.approx(statistics.median(r["ttft_s"] for r in cold) * 1e3)
    assert t["warm_ms"] == pytest.approx(statistics.median(r["ttft_s"] for r in warm) * 1e3)
    assert t["cold_over_warm"] == pytest.approx(t["cold_ms"] / t["warm_ms"])
    assert t["cold_over_warm_spread"] == pytest.approx(
        ratio_spread([r["ttft_s"] for r in cold], [r["ttft_s"] for r in warm])
    )
    assert f"| cold / warm | | {t['cold_over_warm']:.2f}x |" in md
    assert f"| warm (same prefix, new suffix) | 4 | {t['warm_ms']:.1f} |" in md

    assert len(report["chats"]) == len(report["chat_rows"]) == 2
    for chat, row in zip(report["chats"], report["chat_rows"], strict=True):
        with_cache, without = chat["cache"]["turns"], chat["no_cache"]["turns"]
        assert len(with_cache) == len(without) == 3
        assert [t["prompt_tokens"] for t in with_cache] == [t["prompt_tokens"] for t in without]
        assert [t["computed_tokens"] for t in without] == [t["prompt_tokens"] for t in without]
        assert with_cache[0]["hit_tokens"] == 0
        for before, turn in zip(with_cache, with_cache[1:]):  # the conversation so far, and a new message
            assert turn["prompt_tokens"] == before["prompt_tokens"] + len(before["answer"]) + 8
            assert turn["hit_tokens"] >= before["prompt_tokens"], with_cache  # the previous turn's prompt is reused
        assert row["answers_identical"] is True
        assert row["cache_computed"] == sum(t["computed_tokens"] for t in with_cache) < row["prompt_tokens"]
        assert row["no_cache_computed"] == row["prompt_tokens"] == sum(t["prompt_tokens"] for t in with_cache)
        assert row["fraction"] == pytest.approx(row["cache_computed"] / row["prompt_tokens"])
        line = (
            f"| {row['conversation']} | {row['prompt_tokens']} | {row['no_cache_computed']} | "
            f"{row['cache_computed']} | {row['hit_tokens']} | {row['fraction'] * 100:.1f} % | yes |"
        )
        assert line in md

    tp = report["throughput"]
    runs = report["throughput_runs"]
    assert tp["batch"] == 3 and tp["hits"] == tp["hit_tokens"] == 0
    assert tp["lookup_tokens"] == 2 * 3 * 8  # every prompt of the cache arm's timed runs, looked up
    for arm in PREFIX_ARMS:
        xs = [r["tokens"] / r["seconds"] for r in runs if r["arm"] == arm]
        assert len(xs) == 2 and tp[f"{arm}_tok_s"] == pytest.approx(statistics.median(xs))
        assert tp[f"{arm}_spread"] == pytest.approx(spread(xs))
    assert {r["arm"] for r in runs if r["position"] == 0} == set(PREFIX_ARMS)  # rotated
    assert tp["ratio"] == pytest.approx(tp["cache_tok_s"] / tp["no_cache_tok_s"])
    assert f"| 3 | {tp['no_cache_tok_s']:.1f} (" in md and f"| {tp['ratio']:.3f} (" in md


def test_prefix_plan_says_what_fits_the_context() -> None:
    """A shape the daemon would refuse (prompt + max_tokens past the context) is named before any
    request, with the largest prefix that fits."""
    args = build_parser().parse_args(["bench", "--prefix-scenario", "--prefix-tokens", "2000"])
    plan = PrefixPlan.from_args(args)
    assert plan.too_long(4096) is None
    assert plan.too_long(1536) == (
        "--prefix-tokens 2000 + --suffix-tokens 50 + 4 generated tokens exceed the model's context (1536); "
        "use --prefix-tokens 1482 or less"
    )
    fitting = PrefixPlan.from_args(build_parser().parse_args(["bench", "--prefix-tokens", "1482"]))
    assert fitting.too_long(1536) is None
    only = PrefixPlan.from_args(build_parser().parse_args(["bench", "--prefix-parts", "throughput,chat"]))
    assert only.parts == ("chat", "throughput") and only.too_long(1536) is None  # the 2000-token prefix is not run
    assert only.steps() == 3 * (2 + 2) and only.max_tokens_cap == 128
    short = PrefixPlan.from_args(build_parser().parse_args(["bench", "--prefix-tokens", "100"]))
    assert "a 10-turn chat (200 + 10 x (40 + 60) = 1200 tokens) exceeds the model's context (1100)" in str(
        short.too_long(1100)
    )


def test_prefix_tables_say_when_reuse_ran_under_allow_inexact() -> None:
    """``--prefix-allow-inexact``: the tables carry the start-up check's finding when it was overruled,
    and nothing when reuse was exact anyway or not allowed."""
    args = build_parser().parse_args(["bench", "--prefix-scenario", "--prefix-allow-inexact"])
    assert args.prefix_allow_inexact
    inexact = {"serving": True, "verdict": {"exact": False, "reason": "warm differs from cold: 9/10 bytes"}}
    md = prefix_markdown({"meta": {"allow_inexact": True, "prefix_cache": inexact}})
    assert "reuses under --allow-inexact" in md and "warm differs from cold: 9/10 bytes" in md
    exact = {"serving": True, "verdict": {"exact": True, "reason": "warm == cold"}}
    assert "allow-inexact" not in prefix_markdown({"meta": {"allow_inexact": True, "prefix_cache": exact}})
    assert "allow-inexact" not in prefix_markdown({"meta": {"allow_inexact": False, "prefix_cache": inexact}})
