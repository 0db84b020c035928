"""``mlx-batchd bench``'s tables from given samples, with no model and no daemon: every arm's median
and spread, ratios with the range their samples allow, a drafter whose bursts never ran reported
as declined, the physical reference, the HTTP arms, tables written as each batch size finishes,
and the prefix scenario's plan and notes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.bench.arms import HTTP_ARMS, drafter_args
from scheduler.bench.b1 import b1_markdown, b1_rows
from scheduler.bench.batched import Setup, batched_markdown, batched_rows
from scheduler.bench.output import BenchError
from scheduler.bench.prefix import PrefixPlan
from scheduler.bench.prefix_report import prefix_markdown
from scheduler.bench.reference import known_bandwidth, reference_line, reference_tok_s
from scheduler.bench.tables import write_tables
from scheduler.cli import build_parser

CLASSIC = [100.0, 90.0, 110.0]
COUNTS = {"rounds": 10, "drafted_tokens": 40, "accepted_tokens": 30, "emitted_tokens": 40, "round_seconds": 0.25}
NO_ROUNDS = dict.fromkeys(COUNTS, 0)


def test_drafter_args_map_specs_to_daemon_flags() -> None:
    assert drafter_args("mtp:demo") == ["--mtp", "demo"]
    assert drafter_args("mtp:/m/head") == ["--mtp", "/m/head"]
    assert drafter_args("prompt-lookup") == ["--draft", "prompt-lookup"]
    assert drafter_args("/models/draft") == ["--draft", "/models/draft"]
    assert drafter_args("mtp:demo@8") == ["--mtp", "demo", "-k", "8"]
    assert drafter_args("prompt-lookup@2") == ["--draft", "prompt-lookup", "-k", "2"]
    for bad in ("mtp:demo@", "mtp:demo@0", "mtp:demo@x", "mtp:demo@²", "mtp:demo@-3"):
        with pytest.raises(BenchError, match="K after @"):
            drafter_args(bad)


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
    # 25 ms a round; classic's median, 100 tok/s, is 10 ms a step
    assert pl["round_ms"] == pytest.approx(25.0) and pl["round_steps"] == pytest.approx(2.5)
    md = b1_markdown(rows)
    # each repeat's own ratio: 150/100, 160/90, 140/110
    assert pl["paired"] == pytest.approx(1.5) and pl["paired_spread"] == pytest.approx([140 / 110, 160 / 90])
    assert classic["paired"] is None
    assert (
        "| pl | 150.0 | 140.0-160.0 | 1.500x | 1.273-1.778 | 1.500 (1.273-1.778) | 10 | 0.750 | 4.00 | 25.00 (2.50) "
        "| wide |" in md
    )
    assert pl["k"] is None  # no daemon stats: no K to name
    # With its daemon's stats, the arm's drafted tokens a round are named (they differ by drafter).
    gates = {"bursts:pl": {"k": 7}}
    named = b1_rows(samples, {"bursts:pl": COUNTS}, {"bursts:pl": {"level": "wide", "exact": True}}, None, gates)
    assert named[1]["k"] == 7 and "| pl (K = 7) | 150.0 |" in b1_markdown(named)
    drift = {("daemon", 1): [100.0, 50.0, 80.0], ("bursts:pl", 1): [130.0, 65.0, 104.0]}  # 1.3x in every repeat
    (_, drifted) = b1_rows(drift, {"bursts:pl": COUNTS}, {"bursts:pl": {"level": "wide", "exact": True}})
    assert drifted["paired"] == pytest.approx(1.3) and drifted["paired_spread"] == pytest.approx([1.3, 1.3])
    assert drifted["vs_classic_spread"] == pytest.approx([65 / 100, 130 / 50])


@pytest.mark.parametrize(
    ("counts", "verdict", "status"),
    [
        (NO_ROUNDS, {"level": None, "exact": False}, "declined: verdict"),
        (NO_ROUNDS, {"level": "wide", "exact": True}, "declined: no burst round ran"),
        (
            {**NO_ROUNDS, "declined:probing": 1, "declined:profiling": 3, "declined:contention": 0},
            {"level": "mirrored", "exact": True},
            "declined: no burst round ran (profiling 3, probing 1)",
        ),
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
    sourced = write_tables(
        samples,
        setup,
        {**meta, "kv_bytes_per_token": kv, "context": context, "bandwidth_source": "the vendor's peak for X"},
        tmp_path,
    )
    assert "at 100 GB/s (the vendor's peak for X) (10.000 ms per step)" in sourced
    assert json.loads((tmp_path / "daemon_vs_raw.json").read_text())["rows"][0]["ratio_spread"] == row["ratio_spread"]


def test_a_known_device_name_gives_its_vendors_peak_bandwidth_and_others_none() -> None:
    assert known_bandwidth("NVIDIA H200") == 4800.0
    assert known_bandwidth(" Apple M2 Max ") == 400.0
    assert known_bandwidth("Apple M3 Max") is None  # 300 or 400 GB/s by part: --bandwidth-gbs says which
    assert known_bandwidth("Intel(R) Xeon(R) Processor") is None
    assert known_bandwidth("") is None


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


def test_an_arm_the_gate_paused_says_what_the_gate_measured() -> None:
    """A drafter arm declined by the adaptive gate carries the estimate that paused it, and the
    table's notes print it: the figure a reader needs to tell a slow round from a warm-up stall."""
    pause = {"speedup": 0.87, "classic_step_s": 0.0012, "round_s": 0.0064, "tokens_per_round": 4.64, "rounds": 16.0}
    samples = {("daemon", 1): CLASSIC, ("bursts:mtp", 1): [101.0, 99.0, 100.0], ("bursts:pl", 1): CLASSIC}
    counts = {"bursts:mtp": {**NO_ROUNDS, "declined:adaptive": 3}, "bursts:pl": COUNTS}
    verdicts = {"bursts:mtp": {"level": "mirrored", "exact": True}, "bursts:pl": {"level": "wide", "exact": True}}
    ahead = {"on": 0.0051, "off": 0.0058}
    gates = {
        "bursts:mtp": {"last_pause": pause, "ahead_round_s": {"on": None, "off": None}},
        "bursts:pl": {"ahead_round_s": ahead},
    }
    rows = b1_rows(samples, counts, verdicts, gates=gates)
    assert [r["gate_pause"] for r in rows] == [None, pause, None]
    assert [r["ahead_round_s"] for r in rows] == [None, {"on": None, "off": None}, ahead]
    md = b1_markdown(rows)
    assert (
        "mtp: the daemon's adaptive gate last paused bursting at 0.870x its classic steps (16 rounds: 4.64 tokens "
        "a round in 6.40 ms against classic steps of 1.20 ms, medians)"
    ) in md
    assert "pl: the daemon's adaptive gate" not in md
    assert "pl: rounds built ahead took 5.10 ms, not built ahead 5.80 ms (medians, as its gate last timed them)" in md
    assert "mtp: rounds built ahead" not in md


def test_demo_prompts_are_the_demo_commands_text_through_the_served_tokenizer() -> None:
    """``--prompts demo``: the demo command's openings as the demo target's tokenizer encodes them,
    cycled from the repeat's seed, so every arm of a repeat reads the same prompts."""
    from mlx_lm.utils import load_tokenizer

    from scheduler.bench.arms import text_prompts
    from scheduler.cli.demo import DEMO_PROMPTS
    from workers.models.demo import demo_path

    tokenizer = load_tokenizer(demo_path("target"))
    got = text_prompts(tokenizer, DEMO_PROMPTS, 6, seed=3)
    assert len(got) == 6 and got == text_prompts(tokenizer, DEMO_PROMPTS, 6, seed=3)
    assert [tokenizer.decode(p) for p in got] == [DEMO_PROMPTS[(3 + i) % len(DEMO_PROMPTS)] for i in range(6)]
    assert text_prompts(tokenizer, DEMO_PROMPTS, 1, seed=4) == [got[1]]
    assert build_parser().parse_args(["bench"]).prompts == "random"
    assert build_parser().parse_args(["bench", "--prompts", "demo"]).prompts == "demo"


def test_min_seconds_repeats_the_cheap_batch_sizes_until_every_arm_has_its_seconds() -> None:
    """``--min-seconds``: the fixed repeats always run; then a B repeats while any of its arms (the
    B = 1 burst arms included) has timed fewer seconds, at most 4x the repeats; off at 0."""
    setup = Setup((1, 64), ("raw", "engine", "daemon"), ("bursts:pl",), repeats=3, min_seconds=6.0)
    seconds = {(arm, 1): 3 * 0.9 for arm in ("raw", "engine", "daemon", "bursts:pl")}
    assert setup.wants_repeat({}, 1, 0) and setup.wants_repeat({}, 1, 2)
    assert setup.wants_repeat(seconds, 1, 3)  # 2.7 s each after three one-second runs
    seconds = {key: 6.3 for key in seconds} | {("bursts:pl", 1): 5.9}
    assert setup.wants_repeat(seconds, 1, 7)  # one arm short of its seconds keeps B = 1 going
    seconds[("bursts:pl", 1)] = 6.0
    assert not setup.wants_repeat(seconds, 1, 7)
    assert not setup.wants_repeat({}, 1, 12)  # the cap: 4 x 3 repeats
    long_runs = {(arm, 64): 3 * 28.0 for arm in ("raw", "engine", "daemon")}
    assert not setup.wants_repeat(long_runs, 64, 3)  # long runs: the three repeats only
    off = Setup((1,), ("raw", "daemon"), repeats=3)
    assert off.wants_repeat({}, 1, 2) and not off.wants_repeat({}, 1, 3)


def test_the_table_says_how_many_repeats_each_batch_size_ran() -> None:
    arms = ("raw", "engine", "daemon")
    setup = Setup((1, 32), arms, repeats=3, min_seconds=6.0)
    samples = _samples({32: list(arms)}, 3) | _samples({1: list(arms)}, 7)
    rows = batched_rows(samples, setup)
    assert [(r["batch"], r["repeats"]) for r in rows] == [(1, 7), (32, 3)]
    md = batched_markdown(rows, {"repeats": 3, "min_seconds": 6.0})
    assert "median of each B's repeats (B = 1: 7, B = 32: 3; --min-seconds 6)" in md
    even = batched_markdown(batched_rows(_samples({32: list(arms)}, 3), setup), {"repeats": 3})
    assert "median of 3 repeats" in even
