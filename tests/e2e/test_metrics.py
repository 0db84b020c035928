"""The Prometheus exposition of a real daemon, scraped over HTTP and parsed."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import Client
from tests.conftest import start_daemon, wait_for_verdict
from tests.helpers.exposition import VLLM_FAMILIES, VLLM_HISTOGRAMS, strict_problems
from workers import envs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert strict_problems(text) == [], text  # what promtool would refuse
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _rung_forwards(engine: dict[str, Any], rungs: tuple[str, ...]) -> int:
    return sum(r["forwards"] for r in engine["pins"]["pinned"] if r["level"] in rungs)


def test_metrics_move_with_a_real_run(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cache of its own: a verdict another test stored would come back without the probe's forwards.
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    port = _free_port()
    d = start_daemon(tiny_model, tmp_path, "--metrics", f"127.0.0.1:{port}", "--draft", "prompt-lookup", "-k", "3")
    try:
        with Client(d.address, timeout=120) as c:
            wait_for_verdict(c)  # bursts run only once the probe has said so
            probed = c.stats()["engine"]  # the pin's cost came with the verdict
            before = _scrape(port)
            c.generate(tokens=[7, 7, 7, 7, 8, 8, 8, 8], max_tokens=30)
            c.generate(tokens=[5, 6], max_tokens=4)
            time.sleep(0.6)  # the loop publishes a snapshot four times a second
            after = _scrape(port)
            served = c.stats()["engine"]
        tax = probed["pin_tax"]
        assert tax["level"] == "narrow"  # the CPU verdict is wide: a pin would run at the first rung that pins
        rungs = ("narrow", "per-query", "per-query-1")
        assert sorted((r["level"], r["batch"]) for r in tax["rows"]) == [
            (lv, b)
            for lv in rungs
            for b in (1, 8, 32)  # up to the daemon's --max-batch (32)
        ]
        for r in tax["rows"]:
            assert r["ratio"] > 0
            assert (
                after[("mlx_batchd_pin_tax_ratio", (("batch", str(r["batch"])), ("level", r["level"])))] == r["ratio"]
            )
        assert ("mlx_batchd_scoping_saved_seconds", ()) in after
        # Serving never stops to measure it: the rungs' forwards (the probe's only) stay as they were,
        # and the figures are the verdict's.
        assert served["pin_tax"]["rows"] == tax["rows"]
        assert _rung_forwards(served, rungs) == _rung_forwards(probed, rungs) > 0
        ended = sum(
            v
            for (name, labels), v in after.items()
            if name == "mlx_batchd_requests_total" and ("tenant", "local") in labels
        )
        assert ended >= 2
        generated = after[("mlx_batchd_tokens_total", (("kind", "generated"), ("tenant", "local")))]
        assert generated >= 4 and generated > before.get(
            ("mlx_batchd_tokens_total", (("kind", "generated"), ("tenant", "local"))), 0
        )
        assert after[("mlx_batchd_burst_rounds_total", (("drafter", "prompt-lookup"),))] > 0
        assert after[("mlx_batchd_burst_round_seconds_total", (("drafter", "prompt-lookup"),))] > 0
        assert after[("mlx_batchd_pin_collateral_forwards_total", ())] == 0
        assert any(name == "mlx_batchd_verdict_exact" and v == 1.0 for (name, _), v in after.items())
        assert after[("mlx_batchd_requests_in_flight", ())] == 0
        # Distributions observed as they happen.
        assert after[("mlx_batchd_time_to_first_token_seconds_count", ())] >= 2
        assert after[("mlx_batchd_request_duration_seconds_count", ())] >= 2
        assert after[("mlx_batchd_inter_token_latency_seconds_count", ())] >= 10
        assert after[("mlx_batchd_step_seconds_count", (("kind", "burst_round"),))] > 0
        assert after[("mlx_batchd_generated_tokens_total", (("mode", "burst"),))] > 0
        assert after[("mlx_batchd_batch_size_count", ())] > 0  # classic steps profile before bursts
        assert after[("mlx_batchd_step_seconds_count", (("kind", "decode"),))] > 0
    finally:
        assert d.stop() == 0


def test_collateral_under_a_process_wide_pin(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's process-wide pin, kept as the bench's arm (here at the operator's narrow level):
    batched decode that never asked for it runs pinned, and the exposition says so; scoped (above)
    it stays 0."""
    monkeypatch.setenv(envs.BENCH_PROCESS_PIN.name, "1")
    port = _free_port()
    d = start_daemon(
        tiny_model,
        tmp_path,
        "--metrics",
        f"127.0.0.1:{port}",
        "--draft",
        "prompt-lookup",
        "--pin-level",
        "narrow",
    )
    try:
        with Client(d.address, timeout=120) as c:
            wait_for_verdict(c, timeout=60)
            c.generate(tokens=[5, 6], max_tokens=20)
            time.sleep(0.6)
            after = _scrape(port)
            engine = c.stats()["engine"]
        assert engine["pin_scope"] == "process" and engine["pin_tax"]["estimated_seconds_saved_by_scoping"] == 0.0
        assert after[("mlx_batchd_pin_collateral_forwards_total", ())] > 0
        assert after[("mlx_batchd_pin_collateral_seconds_total", ())] > 0
        assert any(name == "mlx_batchd_verdict_probe_seconds" and v > 0 for (name, _), v in after.items())
    finally:
        assert d.stop() == 0


def test_an_idle_engine_gives_its_mlx_cache_back(tiny_model: Path, tmp_path: Path) -> None:
    """After work, once idle, MLX's cache of freed buffers is emptied (other processes on the same
    GPU need that memory), and the engine's MLX memory is in stats and in the exposition."""
    port = _free_port()
    d = start_daemon(tiny_model, tmp_path, "--metrics", f"127.0.0.1:{port}")
    try:
        with Client(d.address, timeout=120) as c:
            c.generate(tokens=[5, 6, 7], max_tokens=40)
            deadline = time.monotonic() + 30
            while (memory := c.stats()["engine"]["memory"])["cache_bytes"] != 0:
                assert time.monotonic() < deadline, memory
                time.sleep(0.05)
            assert memory["peak_bytes"] > 0 and memory["active_bytes"] > 0  # the weights, at least
            time.sleep(0.6)  # the loop publishes a snapshot four times a second
            scraped = _scrape(port)
        assert scraped[("mlx_batchd_mlx_memory_bytes", (("kind", "cache"),))] == 0
        assert scraped[("mlx_batchd_mlx_memory_bytes", (("kind", "peak"),))] == memory["peak_bytes"]
    finally:
        assert d.stop() == 0, d.log()


def test_vllm_named_aliases_of_a_real_daemon(tiny_model: Path, tmp_path: Path) -> None:
    """A dashboard made for vLLM reads this daemon: its ``vllm:`` families (vLLM's names, types and
    ``model_name``/``engine`` labels) carry the same numbers as the daemon's own, in one valid page."""
    port = _free_port()
    d = start_daemon(tiny_model, tmp_path, "--metrics", f"127.0.0.1:{port}", "--kv-budget-mb", "64")
    try:
        with Client(d.address, timeout=120) as c:
            model = c.health()["model"]["name"]
            c.generate(tokens=[5, 6, 7], max_tokens=12)
            c.generate(tokens=[9, 9], max_tokens=6)
            deadline = time.monotonic() + 30
            while True:  # the loop publishes a snapshot four times a second
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                got = _scrape(port)
                labels = (("engine", "0"), ("model_name", model))
                if got.get(("vllm:generation_tokens_total", labels)) == 18:  # both requests' tokens published
                    break
                assert time.monotonic() < deadline, got
                time.sleep(0.05)
            stats = c.stats()
        types = {f.name: f.type for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}
        assert types == VLLM_FAMILIES
        assert got[("vllm:num_requests_running", labels)] == got[("mlx_batchd_active_sequences", ())] == 0
        assert got[("vllm:num_requests_waiting", labels)] == got[("mlx_batchd_requests_waiting", ())] == 0
        assert (
            got[("vllm:generation_tokens_total", labels)]
            == 18
            == got[("mlx_batchd_tokens_total", (("kind", "generated"), ("tenant", "local")))]
        )
        assert (
            got[("vllm:prompt_tokens_total", labels)]
            == got[("mlx_batchd_tokens_total", (("kind", "prompt"), ("tenant", "local")))]
            == 5
        )
        assert got[("vllm:kv_cache_usage_perc", labels)] == stats["kv_reserved_bytes"] / stats["kv_budget_bytes"]
        assert stats["kv_budget_bytes"] == 64 << 20
        for alias, own in VLLM_HISTOGRAMS.items():
            assert got[(f"{alias}_count", labels)] == got[(f"{own}_count", ())] > 0, alias
            assert got[(f"{alias}_sum", labels)] == got[(f"{own}_sum", ())], alias
            assert got[(f"{alias}_bucket", tuple(sorted((("le", "+Inf"), *labels))))] == got[(f"{own}_count", ())]
    finally:
        assert d.stop() == 0, d.log()
