"""The prefix cache on real tiny models (llama, qwen3, gemma3 with sliding-window layers), on the CPU.

A warm prompt (its prefix's KV copied from an earlier sequence, only the suffix prefilled) must
produce exactly the cold prompt's tokens; entries stay under the byte bound; a salt never reads
another salt's entries; a cancelled sequence's entry is as good as a finished one's. Run as a
module, it prints the TTFT of a 2,000-token shared prefix + 50-token suffix, warm vs cold (``python
-m tests.engine.test_prefix_cache [MODEL]``) or the prefill share of a 10-turn chat (``... chat``).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.metrics import StatsCollector
from tests.helpers.stats import stats_snapshot
from tests.reference import probed_bursts
from workers.api import BurstSettings, EngineSettings, Finished, Job, Ready, Signal, Tokens, salt_for
from workers.engine.engine import Engine
from workers.engine.loop import EngineThread
from workers.engine.prefix_cache import PrefixCache, checked
from workers.engine.prefix_check import ReuseVerdict
from workers.engine.spec.drafters import DraftModel
from workers.models.loading import load as load_model
from workers.models.synthetic import BYTE_VOCAB, build_model, gemma3_config, qwen3_config

VOCAB = BYTE_VOCAB
STEP = 64  # small prefill chunks, so prompts here cross chunk boundaries (and the 256-token KV step)
WINDOW = 64
A, B = salt_for("a", False), salt_for("b", False)


@pytest.fixture(scope="module")
def models(tiny_model: Path) -> dict[str, Any]:
    return {
        "llama": load(str(tiny_model))[0],
        "qwen3": build_model(qwen3_config(), seed=3),
        "gemma3": build_model(gemma3_config(window=WINDOW), seed=3),
    }


def engine_for(model: Any, max_bytes: int = 64 << 20, window: int | None = None, **kw: Any) -> Engine:
    engine = Engine(model, eos_token_ids=(), vocab_size=VOCAB, max_batch=8, prefill_step=STEP)
    if max_bytes:
        engine.prefix_cache = checked(
            engine.counted, max_bytes, prefill_step=STEP, vocab_size=VOCAB, window=window, context=4096, **kw
        )
    return engine


Output = list[tuple[int, float]]


def run(engine: Engine, *jobs: Job) -> dict[int, Output]:
    """Submit ``jobs`` together and step until the engine is idle; every job must end by length.

    Each token comes with its logprob: random-weight models often pick the same tokens from other
    contexts, the logprobs show any byte of difference."""
    out: dict[int, Output] = {j.seq: [] for j in jobs}
    for j in jobs:
        engine.submit(replace(j, logprobs=True))
    for _ in range(5000):
        if not engine.has_work:
            return out
        for e in engine.step():
            if isinstance(e, Tokens):
                assert e.logprobs is not None
                out[e.seq] += zip(e.tokens, e.logprobs, strict=True)
            elif isinstance(e, Finished):
                assert e.reason == "length", e
    raise AssertionError("the engine did not finish")


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def ids(out: Output) -> list[int]:
    return [t for t, _ in out]


def cold(model: Any, prompt: list[int], n: int) -> Output:
    return run(engine_for(model, 0), Job(seq=0, prompt=prompt, max_tokens=n))[0]


def stats(engine: Engine) -> dict[str, Any]:
    assert engine.prefix_cache is not None
    return engine.prefix_cache.snapshot()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_warm_output_is_byte_identical_to_cold(models: dict[str, Any], family: str) -> None:
    """A shared prefix (another request's prompt), a second turn (the first turn's prompt and output)
    and a batch mixing warm and cold prompts, each against its own cold run."""
    model = models[family]
    window = WINDOW if family == "gemma3" else None
    # gemma3 reuses only entries within its window: a short prefix; the outputs still run past it.
    shared, tail, n = (tokens(30, 1), 6, 20) if window else (tokens(200, 1), 30, 24)
    engine = engine_for(model, window=window)
    verdict = engine.prefix_cache.verdict if engine.prefix_cache else None
    assert verdict is not None and verdict.exact and verdict.window_only == bool(window), verdict
    first = shared + tokens(tail, 2)
    out1 = run(engine, Job(seq=1, prompt=first, max_tokens=n, cache_salt=A))[1]
    second = shared + tokens(tail, 3)
    turn2 = first + ids(out1) + tokens(5, 4)
    other = tokens(len(second), 5)
    jobs = [Job(seq=2, prompt=second, max_tokens=n, cache_salt=A), Job(seq=3, prompt=other, max_tokens=n, cache_salt=A)]
    if window:  # mlx-lm's batched rotating caches make even cold output depend on a companion's padding
        got = run(engine, jobs[0]) | run(engine, jobs[1])
    else:  # a warm and a cold prompt prefilled in one batch
        got = run(engine, *jobs)
    got |= run(engine, Job(seq=4, prompt=turn2, max_tokens=n + 40, cache_salt=A))
    assert out1 == cold(model, first, n)
    assert got[2] == cold(model, second, n)
    assert got[3] == cold(model, other, n)
    assert got[4] == cold(model, turn2, n + 40)
    s = stats(engine)
    assert s["queries"] == 4 and s["hits"] == 2, s
    assert s["hit_tokens"] >= len(shared) + len(first) + len(out1) - 1, s
    if window:  # the second turn's entry is past the window: refused
        assert s["past_window"] == 1 and s["stored"] == 3, s
    else:
        assert s["past_window"] == 0 and s["stored"] == 4, s


def test_gemma3_past_the_window_differs_on_the_cpu_and_only_entries_within_it_serve(models: dict[str, Any]) -> None:
    """The check finds a real divergence (a prefix past the sliding window, on the CPU) and the verdict
    it gives keeps those entries out; without a window to fall back on, reuse is declined."""
    engine = engine_for(models["gemma3"], window=WINDOW)
    assert engine.prefix_cache is not None and engine.prefix_cache.verdict is not None
    draws = engine.prefix_cache.verdict.draws
    assert any(d.past_window and d.differing_bytes for d in draws)
    assert all(d.differing_bytes == 0 for d in draws if not d.past_window and d.skipped is None)
    long = tokens(150, 7)
    run(engine, Job(seq=1, prompt=long, max_tokens=8, cache_salt=A))
    run(engine, Job(seq=2, prompt=long + tokens(10, 8), max_tokens=8, cache_salt=A))
    s = stats(engine)
    assert s["hits"] == 0 and s["entries"] == 0 and s["past_window"] == 2, s


def test_a_declined_verdict_serves_nothing_unless_inexact_is_allowed(models: dict[str, Any]) -> None:
    prompt = tokens(100, 9)
    for allow, served in ((False, 0), (True, 1)):
        engine = engine_for(models["llama"], 0)
        engine.prefix_cache = PrefixCache(64 << 20, ReuseVerdict(False, "declined for the test"), allow_inexact=allow)
        run(engine, Job(seq=1, prompt=prompt, max_tokens=4, cache_salt=A))
        run(engine, Job(seq=2, prompt=prompt + [5], max_tokens=4, cache_salt=A))
        assert stats(engine)["hits"] == served and stats(engine)["serving"] == bool(allow)


def test_eviction_keeps_the_bytes_under_the_bound(models: dict[str, Any]) -> None:
    model = models["llama"]
    engine = engine_for(model, 0)
    prompts = [tokens(120, 20 + i) for i in range(5)]
    engine.prefix_cache = PrefixCache(1 << 40, ReuseVerdict(True, "measuring one entry"))
    run(engine, Job(seq=0, prompt=prompts[0], max_tokens=4, cache_salt=A))
    one = stats(engine)["bytes"]
    assert one > 0
    bound = int(2.5 * one)
    engine.prefix_cache = PrefixCache(bound, ReuseVerdict(True, "two and a half entries"))
    for i, p in enumerate(prompts):
        run(engine, Job(seq=i, prompt=p, max_tokens=4, cache_salt=A))
        assert 0 < stats(engine)["bytes"] <= bound
    s = stats(engine)
    assert s["entries"] == 2 and s["evictions"] == 3, s
    pc = engine.prefix_cache
    assert pc is not None
    assert [bool(pc.lookup(A, p + [7]).cached) for p in prompts] == [False, False, False, True, True]
    engine.prefix_cache = PrefixCache(one // 2, ReuseVerdict(True, "smaller than one entry"))
    run(engine, Job(seq=20, prompt=prompts[0], max_tokens=4, cache_salt=A))
    assert stats(engine)["too_large"] == 1 and stats(engine)["bytes"] == 0


def test_tenants_never_hit_each_others_prefixes_unless_shared(models: dict[str, Any]) -> None:
    engine = engine_for(models["llama"])
    system = tokens(150, 30)
    run(engine, Job(seq=1, prompt=system + tokens(10, 31), max_tokens=4, cache_salt=A))
    run(engine, Job(seq=2, prompt=system + tokens(10, 32), max_tokens=4, cache_salt=B))
    run(engine, Job(seq=3, prompt=system + tokens(10, 33), max_tokens=4))  # no salt: no lookup, no entry
    assert stats(engine)["hits"] == 0 and stats(engine)["queries"] == 2
    run(engine, Job(seq=4, prompt=system + tokens(10, 34), max_tokens=4, cache_salt=B))
    assert stats(engine)["hits"] == 1  # B hits its own
    shared = salt_for("a", True)
    assert shared == salt_for("b", True) and shared not in (A, B, salt_for("shared", False))
    run(engine, Job(seq=5, prompt=system + tokens(10, 35), max_tokens=4, cache_salt=shared))
    assert stats(engine)["hits"] == 1  # the shared salt sees neither tenant's entries
    run(engine, Job(seq=6, prompt=system + tokens(10, 36), max_tokens=4, cache_salt=shared))
    assert stats(engine)["hits"] == 2


def _step_until(engine: Engine, done: Any) -> None:
    for _ in range(1000):
        if done():
            return
        engine.step()
    raise AssertionError("never got there")


@pytest.mark.parametrize("where", ["prefilling", "decoding", "paused"])
def test_a_cancelled_sequences_entry_serves_exact_output(models: dict[str, Any], where: str) -> None:
    model = models["llama"]
    engine = engine_for(model)
    prompt = tokens(300, 40)
    engine.submit(Job(seq=1, prompt=prompt, max_tokens=50, cache_salt=A))
    if where == "prefilling":  # two 64-token chunks in
        _step_until(
            engine, lambda: engine._gen._prompt_batch.tokens and len(engine._gen._prompt_batch.tokens[0]) >= 128
        )
    else:
        _step_until(engine, lambda: engine.counters.generated_tokens >= 10)
    if where == "paused":
        engine.pause(1)
        assert engine.paused == 1 and not engine.has_work
    ends = engine.cancel(1)
    assert [e.reason for e in ends if isinstance(e, Finished)] == ["cancelled"]
    s = stats(engine)
    assert s["stored"] == 1 and s["entries"] == 1, s
    again = prompt + tokens(20, 41)
    got = run(engine, Job(seq=2, prompt=again, max_tokens=12, cache_salt=A))[2]
    assert got == cold(model, again, 12)
    hit = stats(engine)["hit_tokens"]
    assert (hit >= 128 and hit < len(prompt)) if where == "prefilling" else hit >= len(prompt), stats(engine)


def test_a_sequence_ended_by_its_pending_token_on_resume_leaves_an_entry(models: dict[str, Any]) -> None:
    engine = engine_for(models["llama"])
    prompt = tokens(100, 45)
    engine.submit(Job(seq=1, prompt=prompt, max_tokens=8, cache_salt=A))
    _step_until(engine, lambda: engine.counters.generated_tokens >= 7)
    engine.pause(1)
    ends = [e for e in engine.resume(1) if isinstance(e, Finished)]
    assert [e.reason for e in ends] == ["length"] and stats(engine)["stored"] == 1


def test_an_engine_failure_keeps_nothing(models: dict[str, Any]) -> None:
    engine = engine_for(models["llama"])
    engine.submit(Job(seq=1, prompt=tokens(100, 50), max_tokens=20, cache_salt=A))
    _step_until(engine, lambda: engine.counters.generated_tokens >= 2)
    engine.cancel_all("error", "shutdown", "the daemon is shutting down")
    assert stats(engine)["stored"] == 0


def test_a_burst_starts_from_a_cached_prefix_and_leaves_its_own(models: dict[str, Any]) -> None:
    """A lone sequence leaves the batch for speculative bursts: it starts from the prefix cache and,
    under an exact verdict, its burst cache becomes an entry the next turn hits."""
    target = models["llama"]
    settings = BurstSettings(k=3, audit_fraction=0.0, profile_steps=0, min_rounds=10**9)
    engine = engine_for(target)
    probed_bursts(engine, target, DraftModel(target, name="self"), settings, "prefix+self", VOCAB)
    first = tokens(180, 60)
    out1 = run(engine, Job(seq=1, prompt=first, max_tokens=30, cache_salt=A))[1]
    second = first + ids(out1) + tokens(8, 61)
    out2 = run(engine, Job(seq=2, prompt=second, max_tokens=30, cache_salt=A))[2]
    assert engine.bursts.bursts >= 2 and engine.bursts.rounds > 0
    assert out1 == cold(target, first, 30) and out2 == cold(target, second, 30)
    s = stats(engine)
    assert s["stored"] == 2 and s["hits"] == 1 and s["hit_tokens"] >= len(first) + len(out1) - 1, s


def test_counters_reach_the_snapshot_and_the_metrics(tiny_model: Path) -> None:
    signals: list[Signal] = []
    thread = EngineThread(
        lambda: load_model(str(tiny_model), 4096), signals.extend, EngineSettings(prefix_cache_bytes=32 << 20)
    )
    thread.start()
    deadline = time.monotonic() + 120
    while not any(isinstance(s, Ready) for s in signals):
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    # Not stored yet, the cache's check runs between steps after Ready; the cache serves once it passed.
    while any(r["status"] not in ("done", "failed") for r in thread.engine_snapshot()["start_up"].values()):  # type: ignore[index]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    prompt = tokens(100, 70)
    for seq in (1, 2):
        thread.submit(Job(seq=seq, prompt=prompt + [seq + 4], max_tokens=3, cache_salt=A))
        while sum(isinstance(s, Finished) for s in signals) < seq:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    snap = thread.snapshot()
    thread.shutdown()
    thread.join(30)
    pc = snap["prefix_cache"]
    assert pc["serving"] and pc["verdict"]["exact"] and pc["queries"] == 2 and pc["hits"] == 1, pc
    registry = CollectorRegistry()
    reply = stats_snapshot(uptime=1.0, generated=0, emitted=0, drafted=0, accepted=0)
    registry.register(StatsCollector(lambda: {**reply, "engine": snap}))
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
        if "prefix_cache" in s.name
    }
    assert samples == {
        "mlx_batchd_prefix_cache_queries_total": 2,
        "mlx_batchd_prefix_cache_hits_total": pc["hit_tokens"],
        "mlx_batchd_prefix_cache_bytes": pc["bytes"],
        "mlx_batchd_prefix_cache_evictions_total": 0,
    }
    assert pc["hit_tokens"] >= 100 and pc["bytes"] > 0


def measure(model_spec: str = "demo", prefix: int = 2000, suffix: int = 50, reps: int = 3) -> None:
    """TTFT through the engine: a cold prompt vs the same-length prompt whose prefix is cached."""
    loaded = load_model(model_spec, prefix + suffix + 64)
    vocab = loaded.info.vocab_size
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=vocab)
    engine.prefix_cache = checked(
        engine.counted,
        1 << 30,
        prefill_step=engine.prefill_step,
        vocab_size=vocab,
        window=None,
        context=loaded.info.context_length,
        allow_inexact=False,
    )

    def ttft(job: Job) -> float:
        engine.submit(job)
        while engine.has_work:
            for e in engine.step():
                if isinstance(e, Finished):
                    assert e.timings.ttft_s is not None
                    return e.timings.ttft_s
        raise AssertionError("no end")

    rng = random.Random(0)

    def draw(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    shared = draw(prefix)
    ttft(Job(seq=-1, prompt=draw(prefix + suffix), max_tokens=1))  # warm-up
    ttft(Job(seq=-2, prompt=shared + draw(suffix), max_tokens=1, cache_salt=A))  # leaves the entry
    colds = [ttft(Job(seq=i, prompt=draw(prefix + suffix), max_tokens=1)) for i in range(reps)]
    warms = [ttft(Job(seq=10 + i, prompt=shared + draw(suffix), max_tokens=1, cache_salt=A)) for i in range(reps)]
    c, w = statistics.median(colds), statistics.median(warms)
    print(f"model {model_spec}, prefix {prefix} + suffix {suffix} tokens, median of {reps}")
    print("| run | TTFT (ms) |\n|---|---|")
    print(f"| cold | {c * 1e3:.1f} |\n| warm | {w * 1e3:.1f} |\n| cold / warm | {c / w:.1f}x |")
    assert engine.prefix_cache is not None
    print("prefix cache:", {k: v for k, v in engine.prefix_cache.snapshot().items() if k != "verdict"})


def measure_chat(turns: int = 10, system: int = 200, user: int = 40, reply: int = 60) -> None:
    """A chat replayed through the engine (each turn's prompt is the whole conversation so far): the
    share of the cache-less prefill that is still computed."""
    from workers.models.synthetic import llama_config

    engine = Engine(build_model(llama_config(), seed=1), eos_token_ids=(), vocab_size=VOCAB)
    engine.prefix_cache = checked(
        engine.counted, 1 << 30, prefill_step=2048, vocab_size=VOCAB, window=None, context=8192
    )
    conversation = tokens(system, 1)
    for turn in range(turns):
        conversation += tokens(user, 100 + turn)
        conversation += ids(run(engine, Job(seq=turn, prompt=conversation, max_tokens=reply, cache_salt=A))[turn])
    s = engine.prefix_cache.snapshot()
    print(f"{turns} turns: {s['lookup_tokens']} prompt tokens, {s['hit_tokens']} from the cache, ", end="")
    print(f"prefilled {1 - s['hit_rate']:.1%} of the cache-less total")


if __name__ == "__main__":
    if sys.argv[1:2] == ["chat"]:
        measure_chat()
    else:
        measure(sys.argv[1] if len(sys.argv) > 1 else "demo")
