"""``mlx-batchd bench`` on a tiny real model with its real daemons: every arm runs, the tables agree
with the JSON, a drafter whose bursts never run is reported as declined, a SIGTERM keeps the rows
finished so far and stops the daemons, the HTTP door is measured beside ZeroMQ, and the prefix
scenario lands in its tables."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import workers.kernels.seam
from scheduler.affinity import allowed_cpus, plan_split
from scheduler.bench.arms import HTTP_ARMS, http_generate, run_engine
from scheduler.bench.prefix import PREFIX_ARMS
from scheduler.bench.spreads import ratio_spread, spread
from scheduler.cli import build_parser
from tests.reference import perturb
from workers import kernels


def store_declined_verdict(model: Path, drafter: str = "prompt-lookup") -> None:
    """Probe, in this process, exactly the pairing that ``serve --draft DRAFTER`` probes, with a
    divergence no kernel level avoids injected at the named test seam (the output head differs
    whenever it runs pinned or on several rows, while classic decode runs it on one row, wide).
    The declined verdict lands in the verdict store (``$MLX_BATCHD_CACHE``), where a daemon started
    afterwards finds it: the bench's drafter daemon then decodes classically, by construction."""
    from workers.api import EngineSettings
    from workers.engine.engine import Engine
    from workers.engine.startup import configure_bursts
    from workers.models.loading import load

    loaded = load(str(model))
    vocab = loaded.info.vocab_size
    engine = Engine(loaded.model, eos_token_ids=loaded.info.eos_token_ids, vocab_size=vocab)

    def no_level_is_exact(kind: str, out: mx.array, rows: int) -> mx.array:
        head = kind == "projection" and out.shape[-1] == vocab
        return perturb(out) if head and (rows > 1 or kernels.current_level() is not kernels.Level.WIDE) else out

    workers.kernels.seam.divergence_seam = no_level_is_exact
    try:
        configure_bursts(engine, loaded, EngineSettings(draft=drafter))
        while engine.probing:
            engine.probe_step()
    finally:
        workers.kernels.seam.divergence_seam = None
    assert engine.pairing is not None and engine.verdicts[engine.pairing].level is None


def test_bench_matrix_runs_every_arm_and_a_declined_drafter_reads_classic(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))  # this test's declined verdict stays here
    store_declined_verdict(tiny_model)
    out = tmp_path / "bench"
    engine_cpus: list[set[int] | None] = []
    given = allowed_cpus()

    def engine_arm(*a: Any) -> tuple[int, float]:
        """The engine alone, noting the CPUs it ran on (``None`` where the OS cannot say)."""
        get = getattr(os, "sched_getaffinity", None)
        engine_cpus.append(None if get is None else set(get(0)))
        return run_engine(*a)

    monkeypatch.setattr("scheduler.bench.matrix.run_engine", engine_arm)
    args = build_parser().parse_args(
        [
            *("bench", "--model", str(tiny_model), "--batch-sizes", "1,2", "--tokens", "8", "--prompt-tokens", "8"),
            *("--repeats", "7", "--process-pin", "narrow", "--drafters", "prompt-lookup", "--bandwidth-gbs", "100"),
            *("--poisson-rate", "20", "--poisson-requests", "4", "--poisson-tokens", "3", "--out", str(out)),
        ]
    )
    assert isinstance(args, argparse.Namespace) and args.bandwidth_gbs == 100.0
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()
    measured = [x for x in printed if x.startswith("bench [")]
    assert len(measured) == 7 * (5 + 4) and measured[-1].startswith(f"bench [{7 * 9}/{7 * 9}] B = 2, repeat 7/7")
    assert printed[-1] == f"results in {out.resolve()}"
    # B = 2's shapes ran once, untimed, in every arm before its first timed repeat
    warm = printed.index("bench: B = 2, warming every arm up (untimed)")
    assert warm < printed.index(next(x for x in measured if " B = 2," in x))
    names = {p.name for p in out.iterdir()}
    for stem in ("daemon_vs_raw", "b1_bursts", "poisson"):
        assert {f"{stem}.json", f"{stem}.md", f"{stem}.png"} <= names
    batched = json.loads((out / "daemon_vs_raw.json").read_text())
    assert [r["batch"] for r in batched["rows"]] == [1, 2] and batched["meta"]["complete"] is True
    assert batched["meta"]["bandwidth_gb_s"] == 100.0 and batched["meta"]["bandwidth_source"] == "--bandwidth-gbs"
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
        assert (r["bursts"] is not None) == r["arm"].startswith("bursts:"), r
        assert r["bursts"] is None or r["bursts"] == dict.fromkeys(
            ("rounds", "round_seconds", "ahead_rounds", "fused_rounds"), 0
        )  # declined: no round
        steps = r["engine_steps"]
        if r["arm"] == "raw":
            assert steps is None
        else:
            assert steps["steps"] >= steps["decode_steps"] >= r["tokens"] / r["batch"] - 1, r
            assert steps["step_seconds"] >= steps["decode_seconds"] > 0, r
            assert 0 < steps["step_cpu_seconds"] <= steps["step_seconds"] + 1e-3, r  # the engine thread's own
            # a daemon's engine loop: its iterations and hand-over seconds; the engine alone has no loop
            assert (r["arm"] == "engine") == ("emit_seconds" not in steps), r
            assert r["arm"] == "engine" or (steps["iterations"] >= steps["steps"] and steps["emit_seconds"] > 0), r
    assert firsts == {"raw", "engine", "daemon", "daemon_process_pin", "bursts:prompt-lookup"}
    # the probe time of every probing daemon is reported (process pin and the drafter's)
    assert any(k.startswith("bursts:prompt-lookup") for k in batched["meta"]["probe_seconds"])
    assert any(k.startswith("daemon_process_pin") for k in batched["meta"]["probe_seconds"])
    # the process-wide pin is that arm's alone (the bench sets it for that daemon, serve has no option)
    scopes = batched["meta"]["pin_scope"]
    assert scopes == {"daemon": "scoped", "daemon_process_pin": "process", "bursts:prompt-lookup": "scoped"}
    # compiled layers: off under the CPU's policy, in the engine alone and in every daemon alike
    assert set(batched["meta"]["compiled_layers"].values()) == {0}
    assert set(batched["meta"]["compiled_layers"]) >= {"engine", "daemon", "daemon_process_pin"}
    # the in-process arms ran where the daemon arm's engine process runs (its share of the CPU split)
    split = plan_split(given)
    assert batched["meta"]["in_process_cpus"] == (None if split is None else list(split.engine))
    if split is not None:
        assert engine_cpus and all(c == set(split.engine) for c in engine_cpus), engine_cpus
        assert allowed_cpus() == given  # and this process got its CPUs back
    assert (split is not None) == ("the raw and engine arms ran on CPUs" in (out / "daemon_vs_raw.md").read_text())
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
    # the arm's K as its daemon served (prompt lookup's default), in the JSON and the table
    assert declined["k"] == 4 and "| prompt-lookup (K = 4) |" in md
    assert "declined: verdict (ratio" in md and "physical limit at B = 1" in md
    poisson = json.loads((out / "poisson.json").read_text())["result"]
    assert poisson["requests"] == 4 and poisson["daemon"] == "bursts:prompt-lookup"
    assert 0 < poisson["ttft_p50"] <= poisson["ttft_p99"]
    assert poisson["budgets"] == "3 tokens each" and len(poisson["tokens"]) == 4 and max(poisson["tokens"]) == 3
    assert "4 requests at 20/s, budgets 3 tokens each." in (out / "poisson.md").read_text()


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


def test_a_bench_stopped_during_b1_keeps_the_burst_rows_of_its_finished_repeats(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM in B = 1's second repeat (from inside the engine arm): the burst table of the first
    repeat is on disk, marked partial, with the drafter arm's run in it."""
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    store_declined_verdict(tiny_model)
    engine_arm, timed = run_engine, []

    def interrupted(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        if max_tokens == 12:  # the measured shape's run and the timed ones (warm-up runs ask for 8)
            timed.append(1)
            if len(timed) == 3:
                signal.raise_signal(signal.SIGTERM)
        return engine_arm(engine, prompts, max_tokens)

    monkeypatch.setattr("scheduler.bench.matrix.run_engine", interrupted)
    out = tmp_path / "bench"
    args = build_parser().parse_args(
        [
            *("bench", "--model", str(tiny_model), "--batch-sizes", "1", "--tokens", "12", "--prompt-tokens", "4"),
            *("--repeats", "2", "--drafters", "prompt-lookup", "--raw-max-batch", "1", "--out", str(out)),
        ]
    )
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            args.func(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    b1 = json.loads((out / "b1_bursts.json").read_text())
    assert b1["meta"]["repeats_done"] == 1 and [r["drafter"] for r in b1["rows"]] == [
        "classic (no drafter)",
        "prompt-lookup",
    ]
    assert {r["arm"] for r in b1["runs"]} >= {"daemon", "bursts:prompt-lookup"} and {
        r["repeat"] for r in b1["runs"]
    } == {0}
    assert (out / "b1_bursts.md").read_text().startswith("partial: 1 of 2 repeats so far")
    assert not (out / "daemon_vs_raw.json").exists()  # B = 1 never finished


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


def args_of(model: Path, out: Path) -> list[str]:
    """A small matrix: B = 1 and 2, four tokens, one repeat."""
    return [
        *("bench", "--model", str(model), "--batch-sizes", "1,2", "--tokens", "4", "--prompt-tokens", "4"),
        *("--repeats", "1", "--out", str(out)),
    ]


def test_bench_min_seconds_repeats_each_batch_size_up_to_its_cap(tiny_model: Path, tmp_path: Path) -> None:
    """``--min-seconds`` far above what any run takes: every B runs its arms, rotated, until the cap (4x
    ``--repeats``); every run is a fresh timed sample with its wall-clock start, and the table and JSON
    say how many repeats each B ran. Far below: the fixed repeats only."""
    out = tmp_path / "bench"
    args = build_parser().parse_args([*args_of(tiny_model, out), "--min-seconds", "1000"])
    assert args.func(args) == 0
    report = json.loads((out / "daemon_vs_raw.json").read_text())
    assert report["meta"]["min_seconds"] == 1000 and report["meta"]["complete"] is True
    assert [(r["batch"], r["repeats"]) for r in report["rows"]] == [(1, 4), (2, 4)]
    runs = report["runs"]
    for b in (1, 2):
        mine = [x for x in runs if x["batch"] == b]
        assert sorted((x["arm"], x["repeat"]) for x in mine) == sorted(
            (arm, rep) for arm in ("raw", "engine", "daemon") for rep in range(4)
        )
        assert {x["arm"] for x in mine if x["position"] == 0} == {"raw", "engine", "daemon"}  # rotated
    starts = [x["started_at"] for x in runs]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert "median of 4 repeats" in (out / "daemon_vs_raw.md").read_text()
    # A microsecond is met by any run: no repeat past --repeats (the runs' seconds are counted).
    args = build_parser().parse_args([*args_of(tiny_model, out), "--min-seconds", "0.000001"])
    assert args.func(args) == 0
    report = json.loads((out / "daemon_vs_raw.json").read_text())
    assert [(r["batch"], r["repeats"]) for r in report["rows"]] == [(1, 1), (2, 1)] and len(report["runs"]) == 6


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
    for arm in PREFIX_ARMS:  # each run's engine steps, read from that daemon's stats around the run
        mine = [r for r in runs if r["arm"] == arm]
        assert all(r["steps"]["decode_steps"] >= 4 and 0 < r["steps"]["step_seconds"] < r["seconds"] for r in mine)
        outside = statistics.median(r["seconds"] - r["steps"]["step_seconds"] for r in mine)
        assert tp["outside_steps_s"][arm] == pytest.approx(outside)
    assert f"cache on {tp['outside_steps_s']['cache']:.3f} s." in md
