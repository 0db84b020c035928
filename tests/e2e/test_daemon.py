"""End to end through a real daemon process, a real ZeroMQ socket and a real MLX model."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import pytest

from clients import AsyncClient, Client, EndEvent, RequestError, TokenEvent
from tests.conftest import Daemon
from tests.reference import greedy_reference, load_reference


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 260) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def test_sixteen_concurrent_greedy_requests_match_mlx_lm_alone(client: Client, tiny_model: Path) -> None:
    prompts = _prompts(16)
    max_tokens = [20 + (i % 5) * 7 for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(
            pool.map(lambda a: client.generate(tokens=a[0], max_tokens=a[1], logprobs=True), zip(prompts, max_tokens))
        )
    assert client.stats()["engine"]["peak_batch_size"] > 1  # they really were decoded together
    for prompt, n, r in zip(prompts, max_tokens, results):
        want_tokens, want_logprobs = greedy_reference(tiny_model, prompt, n)
        assert r.tokens == want_tokens
        assert r.logprobs == want_logprobs
        assert r.finish_reason == ("length" if len(want_tokens) == n else "stop")
        assert r.usage == {"prompt_tokens": len(prompt), "completion_tokens": len(want_tokens)}
        _, tokenizer = load_reference(str(tiny_model))
        assert r.text == tokenizer.decode(want_tokens)


def test_stream_order_and_exactly_one_terminal_event(client: Client) -> None:
    events = list(client.stream(tokens=[5, 6, 7, 8], max_tokens=12))
    ends = [e for e in events if isinstance(e, EndEvent)]
    assert len(ends) == 1 and events[-1] is ends[0]
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    streamed = [t for e in events if isinstance(e, TokenEvent) for t in e.tokens]
    assert ends[0].usage["completion_tokens"] == len(streamed)
    t = ends[0].timings
    assert t["queue_s"] is not None and t["ttft_s"] is not None and t["decode_s"] is not None
    assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["total_s"]


def test_cancel_mid_stream_frees_the_slot(client: Client) -> None:
    rid = "cancel-me"
    seen = 0
    for event in client.stream(tokens=[9, 10, 11], max_tokens=200, request_id=rid):
        if isinstance(event, TokenEvent):
            seen += len(event.tokens)
            if seen == 2:
                client.cancel(rid)
        else:
            end = event
    assert end.finish_reason == "cancelled"
    assert end.usage["completion_tokens"] < 200
    # The engine publishes its gauges after each step; the slot is back once nothing is active.
    for _ in range(100):
        if client.stats()["engine"]["active_sequences"] == 0 and client.stats()["requests_in_flight"] == 0:
            break
        anyio.run(anyio.sleep, 0.05)
    stats = client.stats()
    assert stats["engine"]["active_sequences"] == 0
    assert stats["requests_in_flight"] == 0


def test_leaving_a_stream_early_cancels_it(client: Client) -> None:
    for event in client.stream(tokens=[12, 13], max_tokens=200):
        assert isinstance(event, TokenEvent)
        break
    for _ in range(100):
        if client.stats()["requests_in_flight"] == 0:
            break
        anyio.run(anyio.sleep, 0.05)
    assert client.stats()["requests_in_flight"] == 0


def test_text_prompt_chat_messages_and_stop_string(client: Client, tiny_model: Path) -> None:
    _, tokenizer = load_reference(str(tiny_model))
    r = client.generate("def f(x):", max_tokens=10)
    assert r.tokens == greedy_reference(tiny_model, tokenizer.encode("def f(x):"), 10)[0]
    chat = [{"role": "user", "content": "hello"}]
    r = client.generate(messages=chat, max_tokens=10)
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert r.tokens == greedy_reference(tiny_model, ids, 10)[0]
    assert r.usage["prompt_tokens"] == len(ids)

    # A stop string taken from the greedy output itself: the text ends right before it.
    full = client.generate(tokens=[20, 21, 22], max_tokens=30)
    stop = full.text[5:8]
    assert stop and stop in full.text
    cut = client.generate(tokens=[20, 21, 22], max_tokens=30, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.tokens == full.tokens[: len(cut.tokens)]


def test_stop_token_ids(client: Client) -> None:
    full = client.generate(tokens=[30, 31], max_tokens=20)
    stop_at = full.tokens[4]
    first = full.tokens.index(stop_at)
    r = client.generate(tokens=[30, 31], max_tokens=20, stop_token_ids=[stop_at])
    assert r.finish_reason == "stop"
    assert r.tokens == full.tokens[:first]


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(client: Client) -> None:
    kw = dict(tokens=[40, 41, 42], max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01)
    alone = client.generate(seed=1234, **kw)
    with ThreadPoolExecutor(6) as pool:
        batch = list(pool.map(lambda s: client.generate(seed=s, **kw), [1234, 1, 2, 1234, 3, 4]))
    assert batch[0].tokens == alone.tokens and batch[3].tokens == alone.tokens
    assert len({tuple(r.tokens) for r in batch}) > 1  # different seeds draw different tokens


def test_async_client_many_in_flight(daemon: Daemon, tiny_model: Path) -> None:
    prompts = _prompts(6, seed=3)

    async def main() -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        async with AsyncClient(daemon.address, timeout=120) as c:

            async def one(i: int) -> None:
                out[i] = (await c.generate(tokens=prompts[i], max_tokens=15)).tokens

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            health = await c.health()
            assert health["status"] == "ready"
        return out

    got = anyio.run(main, backend="asyncio")
    assert got == [greedy_reference(tiny_model, p, 15)[0] for p in prompts]


def test_sync_client_shared_between_threads(client: Client) -> None:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            r = client.generate(tokens=[50, 51], max_tokens=8)
            assert r.finish_reason in ("length", "stop")
        except BaseException as exc:  # collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_client_side_duplicate_id_and_timeout(client: Client) -> None:
    events = client.stream(tokens=[60], max_tokens=100, request_id="dup")
    next(events)
    with pytest.raises(Exception, match="already in flight"):
        client.generate(tokens=[60], max_tokens=5, request_id="dup")
    events.close()
    with pytest.raises(TimeoutError):
        client.generate(tokens=[61], max_tokens=200, timeout=0.001)


def test_request_errors_raise_with_code(client: Client) -> None:
    with pytest.raises(RequestError) as info:
        client.generate(tokens=[1, 2, 99999], max_tokens=5)
    assert info.value.code == "token_out_of_range"


def test_cli_generate_round_trip(daemon: Daemon) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "scheduler", "generate", "--addr", daemon.address, "--max-tokens", "6", "hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "[length]" in out.stderr or "[stop]" in out.stderr
    with Client(daemon.address) as c:
        assert out.stdout.rstrip("\n") == c.generate("hello", max_tokens=6).text


def test_cli_stats_summary_and_json(daemon: Daemon) -> None:
    human = subprocess.run(
        [sys.executable, "-m", "scheduler", "stats", "--addr", daemon.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert human.returncode == 0, human.stderr
    assert "mlx-batchd ready" in human.stdout and "tenant local" in human.stdout and "collateral 0" in human.stdout
    raw = subprocess.run(
        [sys.executable, "-m", "scheduler", "stats", "--json", "--addr", daemon.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert raw.returncode == 0 and '"requests_in_flight"' in raw.stdout
