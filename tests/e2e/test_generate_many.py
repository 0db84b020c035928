"""``generate_many``: many jobs sent together through one client, against a real daemon process."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from clients import AsyncClient, Client, RequestError, Result
from tests.conftest import Daemon
from tests.reference import greedy_reference


def _jobs(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"tokens": [rng.randrange(4, 250) for _ in range(rng.randrange(3, 30))], "max_tokens": 6 + (i % 4) * 5}
        for i in range(n)
    ]


def _settled(client: Client, timeout: float = 30) -> dict[str, Any]:
    """``stats`` once no request is in flight (the daemon has ended or cancelled every one)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats["requests_in_flight"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_results_match_mlx_lm_alone_in_the_order_given(client: Client, tiny_model: Path) -> None:
    jobs = _jobs(12, seed=3)
    results = client.generate_many(jobs)
    assert len(results) == len(jobs)
    for job, result in zip(jobs, results):
        want, _ = greedy_reference(tiny_model, job["tokens"], job["max_tokens"])
        assert result.tokens == want
        assert result.usage["prompt_tokens"] == len(job["tokens"])


def test_an_error_takes_its_place_with_return_errors(client: Client, tiny_model: Path) -> None:
    jobs = _jobs(5, seed=4)
    jobs[2] = {"tokens": [5, 10**6], "max_tokens": 4}
    results = client.generate_many(jobs, return_errors=True)
    bad = results[2]
    assert isinstance(bad, RequestError) and bad.code == "token_out_of_range"
    for i in (0, 1, 3, 4):
        result = results[i]
        assert isinstance(result, Result)
        assert result.tokens == greedy_reference(tiny_model, jobs[i]["tokens"], jobs[i]["max_tokens"])[0]


def test_an_error_cancels_the_others_and_is_raised(client: Client) -> None:
    before = _settled(client)["outcomes"]
    jobs = [{"tokens": [7, 8, 9], "max_tokens": 150} for _ in range(4)]
    jobs.append({"tokens": [5, 10**6], "max_tokens": 4})
    with pytest.raises(RequestError) as caught:
        client.generate_many(jobs)
    assert caught.value.code == "token_out_of_range"
    after = _settled(client)
    assert after["requests_in_flight"] == 0
    cancelled = sum(per.get("cancelled", 0) for per in after["outcomes"].values()) - sum(
        per.get("cancelled", 0) for per in before.values()
    )
    assert cancelled == 4, after["outcomes"]
    assert client.generate(tokens=[7, 8], max_tokens=3).usage["completion_tokens"] == 3  # still serving


def test_a_malformed_job_is_refused_before_anything_is_sent(client: Client) -> None:
    received = client.stats()["messages_received"]
    with pytest.raises(TypeError, match="job 1 has unknown argument"):
        client.generate_many([{"tokens": [5, 6], "max_tokens": 2}, {"tokens": [5], "max_token": 2}])
    with pytest.raises(TypeError, match="job 0 is a list"):
        client.generate_many([[5, 6]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        client.generate_many([{"tokens": [5]}], concurrency=0)
    assert client.stats()["messages_received"] == received + 1  # the first stats call's own message


def test_concurrency_caps_the_jobs_in_flight(daemon: Daemon) -> None:
    class Counting(AsyncClient):
        """The real client, counting its ``generate`` calls in flight."""

        now = 0
        most = 0

        async def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
            Counting.now += 1
            Counting.most = max(Counting.most, Counting.now)
            try:
                return await super().generate(prompt, **kwargs)
            finally:
                Counting.now -= 1

    jobs = _jobs(7, seed=5)

    async def main() -> tuple[list[Result], list[Result]]:
        async with Counting(daemon.address, timeout=120) as client:
            capped = await client.generate_many(jobs, concurrency=2)
            capped_most, Counting.most = Counting.most, 0
            free = await client.generate_many(jobs)
            assert capped_most == 2 and Counting.most == len(jobs)
            return capped, free

    capped, free = anyio.run(main)
    assert [r.tokens for r in capped] == [r.tokens for r in free]


def _delayed(client: Client) -> int:
    """Arrivals the engine held past the iteration that took them (the idle window's waits)."""
    return int(client.stats()["engine"]["admission"]["delayed"])


def test_a_declared_request_skips_the_idle_window_and_an_undeclared_one_pays_it(client: Client) -> None:
    job = {"tokens": [9, 10, 11], "max_tokens": 3}
    before = _delayed(client)
    client.generate_many([job])  # declared: a group of one
    client.generate_many([job, dict(job), dict(job)])  # a group of three, whole when its last arrives
    after_declared = _delayed(client)
    assert after_declared - before <= 2  # only members that came ahead of the rest of their group wait
    client.generate(**job)  # undeclared: waits for a quiet window
    assert _delayed(client) - after_declared == 1


def test_a_group_name_is_the_senders_own(daemon: Daemon) -> None:
    """Two connections each send one member of a group named alike with size 2: neither group is
    whole, so both wait the window; one connection sending both makes its group whole."""

    async def main() -> tuple[int, int]:
        async with AsyncClient(daemon.address, timeout=120) as a, AsyncClient(daemon.address, timeout=120) as b:
            job = {"tokens": [9, 10, 11], "max_tokens": 2, "group": ("shared", 2)}
            start = (await a.stats())["engine"]["admission"]["delayed"]
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: a.generate(**job))
                tg.start_soon(lambda: b.generate(**job))
            apart = (await a.stats())["engine"]["admission"]["delayed"]
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: a.generate(**job))
                tg.start_soon(lambda: a.generate(**job))
            together = (await a.stats())["engine"]["admission"]["delayed"]
            return apart - start, together - apart

    apart, together = anyio.run(main)
    assert apart == 2 and together <= 1
