"""SmolLM2-135M-Instruct (the real GGUF, converted once a session) served end to end by the daemon:
batched greedy output is mlx-lm's alone, chat answers end at the template's end token, stop strings
cut the text, the stream delivers each token's text as soon as it is final, prompt-lookup bursts are
exact and counted, the probe's verdict is recorded and the prefix cache serves warm == cold.

The model decodes about ten tokens a second on the CPU, so the prompts are short, each test
generates a few dozen tokens at most and the context is small (which also keeps the start-up probe
and the prefix cache's check to a few short draws)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from clients import Client, TokenEvent
from tests.conftest import Daemon, start_daemon, wait_for_verdict, wait_started
from tests.reference import greedy_reference, load_reference

PLAIN = ("--context-length", "128", "--prefill-step", "32", "--max-batch", "4", "--prefix-cache-mb", "16")
DRAFTING = ("--context-length", "160", "--max-batch", "2", "--draft", "prompt-lookup", "-k", "3")
PROMPTS = ["The capital of France is", "def add(a, b):\n", "1, 2, 3, 4,"]
NEW = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def plain(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon without a drafter, with the prefix cache: most tests share it."""
    d = start_daemon(smollm2_dir, tmp_path_factory.mktemp("smollm-plain"), *PLAIN)
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture()
def client(plain: Daemon) -> Iterator[Client]:
    with Client(plain.address, timeout=120) as c:
        yield c


def tokenizer(model: Path) -> Any:
    return load_reference(str(model))[1]


def encode(model: Path, text: str) -> list[int]:
    ids: list[int] = tokenizer(model).encode(text, add_special_tokens=False)
    return ids


@cache
def reference(model: Path, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """``mlx_lm``'s greedy tokens for ``prompt`` alone (memoised: several tests compare to one)."""
    return greedy_reference(model, list(prompt), max_tokens)[0]


def test_batched_greedy_output_is_mlx_lm_alone(smollm2_dir: Path, client: Client) -> None:
    prompts = [encode(smollm2_dir, p) for p in PROMPTS]
    results = client.generate_many([{"tokens": p, "max_tokens": NEW} for p in prompts])
    for p, r in zip(prompts, results):
        assert r.tokens == reference(smollm2_dir, tuple(p), NEW), r
        assert r.text == tokenizer(smollm2_dir).decode(r.tokens)


def test_chat_answer_stops_at_the_templates_end_token(smollm2_dir: Path, client: Client) -> None:
    tok = tokenizer(smollm2_dir)
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    r = client.generate(messages=QUESTION, max_tokens=32)
    assert r.finish_reason == "stop" and "Paris" in r.text, r
    assert r.tokens == reference(smollm2_dir, tuple(prompt), 32)  # ended before the budget, at EOS
    assert len(r.tokens) < 32 and r.usage["completion_tokens"] == len(r.tokens)
    assert r.usage["prompt_tokens"] == len(prompt)
    assert tok.eos_token_ids.isdisjoint(r.tokens)
    assert "<|im_end|>" not in r.text and "<|im_start|>" not in r.text


def test_stop_string_cuts_the_text(smollm2_dir: Path, client: Client) -> None:
    prompt = encode(smollm2_dir, PROMPTS[2])
    whole = tokenizer(smollm2_dir).decode(reference(smollm2_dir, tuple(prompt), NEW))
    assert " 7," in whole, whole  # the model counts on
    r = client.generate(tokens=prompt, max_tokens=NEW, stop=["7"])
    assert r.finish_reason == "stop", r
    assert r.text == whole[: whole.index("7")]
    assert len(r.tokens) < NEW


def test_stream_sends_each_tokens_text_as_soon_as_it_is_final(smollm2_dir: Path, client: Client) -> None:
    """After every event the text so far is the decoded tokens so far: nothing is held back but an
    incomplete UTF-8 character. SmolLM splits digits one by one, so a count is a run of single-space
    tokens each followed by a digit (mlx-lm's BPE detokenizer held each such space back a token)."""
    tok = tokenizer(smollm2_dir)
    prompt = encode(smollm2_dir, PROMPTS[2])
    events = [e for e in client.stream(tokens=prompt, max_tokens=NEW) if isinstance(e, TokenEvent)]
    tokens: list[int] = []
    text = ""
    for event in events:
        tokens += event.tokens
        text += event.text
        decoded = tok.decode(tokens)
        if not decoded.endswith("\ufffd"):
            assert text == decoded, (tokens, text)
    assert tokens == reference(smollm2_dir, tuple(prompt), NEW)
    assert text.isascii() and all(e.text for e in events), events  # no event waits for a later one


def test_prefix_cache_warm_equals_cold(smollm2_dir: Path, client: Client) -> None:
    prompt = encode(smollm2_dir, "Here is a list of fruits: apple, banana, cherry, grape, lemon, mango, orange, pear.")
    state = wait_started(client)["prefix_cache"]  # its check runs between steps unless stored
    assert state["serving"] is True, state["verdict"]
    cold = client.generate(tokens=prompt, max_tokens=8)
    before = client.stats()["engine"]["prefix_cache"]
    warm = client.generate(tokens=prompt, max_tokens=8)
    after = client.stats()["engine"]["prefix_cache"]
    assert after["hits"] == before["hits"] + 1 and after["hit_tokens"] > before["hit_tokens"]
    assert (warm.tokens, warm.text) == (cold.tokens, cold.text)
    assert cold.tokens == reference(smollm2_dir, tuple(prompt), 8)


def test_prompt_lookup_bursts_are_exact_and_counted(smollm2_dir: Path, tmp_path: Path) -> None:
    """A copy-heavy prompt: the model repeats a sentence it was given, and prompt lookup drafts it
    from the prompt. The start-up probe's verdict is in ``stats`` first."""
    tok = tokenizer(smollm2_dir)
    sentence = "The quick brown fox jumps over the lazy dog near the river bank."
    messages = [{"role": "user", "content": f"Repeat this sentence exactly: {sentence}"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    d = start_daemon(smollm2_dir, tmp_path, *DRAFTING)
    try:
        with Client(d.address, timeout=120) as c:
            verdict = wait_for_verdict(c)
            assert verdict["exact"] is True and verdict["level"], verdict
            r = c.generate(messages=messages, max_tokens=24)
            bursts = c.stats()["engine"]["bursts"]
    finally:
        assert d.stop() == 0, d.log()
    assert r.tokens == reference(smollm2_dir, tuple(prompt), 24)
    assert "quick brown fox" in r.text, r.text
    assert bursts["drafter"] == "prompt-lookup" and bursts["rounds"] > 0, bursts
    assert 0 < bursts["accepted_tokens"] <= bursts["drafted_tokens"], bursts


def test_a_gguf_file_as_the_draft_model(smollm2_gguf: Path, smollm2_dir: Path, tmp_path: Path) -> None:
    """``--draft FILE.gguf`` is resolved as ``--model`` is (converted into the cache): the model
    drafting for itself, exact, its bursts counted."""
    prompt = encode(smollm2_dir, PROMPTS[2])
    d = start_daemon(smollm2_dir, tmp_path, *DRAFTING[:4], "--draft", str(smollm2_gguf), "-k", "3")
    try:
        with Client(d.address, timeout=120) as c:
            assert wait_for_verdict(c)["exact"] is True
            r = c.generate(tokens=prompt, max_tokens=NEW)
            bursts = c.stats()["engine"]["bursts"]
    finally:
        assert d.stop() == 0, d.log()
    assert r.tokens == reference(smollm2_dir, tuple(prompt), NEW)
    assert bursts["drafter"].startswith("draft:") and bursts["rounds"] > 0, bursts
