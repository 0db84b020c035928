"""Bursts through the real daemon: a prompt-lookup drafter, exact output, counters in stats."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clients import Client
from tests.conftest import start_daemon, wait_for_verdict
from tests.reference import greedy_reference


def test_daemon_bursts_are_exact_and_reported(tiny_model: Path, tmp_path: Path) -> None:
    daemon = start_daemon(tiny_model, tmp_path, "--draft", "prompt-lookup", "-k", "3")
    try:
        with Client(daemon.address, timeout=120) as c:
            wait_for_verdict(c, timeout=60)
            prompt = [7, 7, 7, 7, 8, 8, 8, 8]
            assert c.generate(tokens=prompt, max_tokens=60).tokens == greedy_reference(tiny_model, prompt, 60)[0]
            bursts = c.stats()["engine"]["bursts"]
            assert bursts["drafter"] == "prompt-lookup" and bursts["rounds"] > 0
            assert bursts["accepted_tokens"] <= bursts["drafted_tokens"]
            prompts = [[5, 6, 7], [9, 10], [7, 7, 7, 7, 8, 8, 8, 8], [30, 31, 32, 33]]
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda p: c.generate(tokens=p, max_tokens=40), prompts))
            for p, r in zip(prompts, results):
                assert r.tokens == greedy_reference(tiny_model, p, 40)[0]
            assert c.stats()["engine"]["pins"]["collateral_forwards"] == 0
    finally:
        assert daemon.stop() == 0
