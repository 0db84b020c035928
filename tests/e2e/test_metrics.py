"""The Prometheus exposition of a real daemon, scraped over HTTP and parsed."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from clients import Client
from tests.conftest import start_daemon, wait_for_verdict
from tests.helpers.exposition import strict_problems


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


def test_metrics_move_with_a_real_run(tiny_model: Path, tmp_path: Path) -> None:
    port = _free_port()
    d = start_daemon(tiny_model, tmp_path, "--metrics", f"127.0.0.1:{port}", "--draft", "prompt-lookup", "-k", "3")
    try:
        with Client(d.address, timeout=120) as c:
            wait_for_verdict(c)  # bursts run only once the probe has said so
            before = _scrape(port)
            c.generate(tokens=[7, 7, 7, 7, 8, 8, 8, 8], max_tokens=30)
            c.generate(tokens=[5, 6], max_tokens=4)
            c.stats(measure_tax=True)  # time a batched step pinned vs wide, on demand
            deadline = time.monotonic() + 30
            while not c.stats()["engine"]["pin_tax"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            tax = c.stats()["engine"]["pin_tax"]
            time.sleep(0.6)  # the loop publishes a snapshot four times a second
            after = _scrape(port)
        assert tax["level"] == "narrow" and tax["batch"] >= 2 and tax["ratio"] > 0  # the CPU verdict is wide
        assert after[("mlx_batchd_pin_tax_ratio", (("batch", str(tax["batch"])), ("level", "narrow")))] == tax["ratio"]
        assert ("mlx_batchd_scoping_saved_seconds", ()) in after
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


def test_collateral_under_a_process_wide_pin(tiny_model: Path, tmp_path: Path) -> None:
    """The seed's process-wide pin (here the operator's narrow level): batched decode that never
    asked for it runs pinned, and the exposition says so; scoped (above) it stays 0."""
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
        "--pin-scope",
        "process",
    )
    try:
        with Client(d.address, timeout=120) as c:
            wait_for_verdict(c, timeout=60)
            c.generate(tokens=[5, 6], max_tokens=20)
            time.sleep(0.6)
            after = _scrape(port)
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
