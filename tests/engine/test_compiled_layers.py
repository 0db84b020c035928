"""Decode steps' layers as compiled halves around attention (``workers.kernels.compiled_layers``): the same
logits byte for byte as mlx-lm's own layer code for every family it covers and for a lone sequence, on
real models; only decode steps at ``wide`` take it; verdicts are keyed by it; it fails closed; the raw
peer's ``stock`` block runs without it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import BatchKVCache

from tests.helpers.fastpath import greedy_tokens
from tests.helpers.fastpath import policy as policy
from workers import kernels
from workers.engine.engine import Engine
from workers.engine.stats import engine_snapshot
from workers.kernels import compiled_layers, fastpath
from workers.models.synthetic import build_model, llama_config, qwen3_config, write_model

QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "torch_dtype": "bfloat16",
}
CONFIGS = {
    "llama": llama_config(hidden=128, layers=2, ffn=256, heads=4, kv_heads=2),
    "llama-4bit": llama_config(hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, quant_bits=4),
    "mistral": {**llama_config(hidden=128, layers=2, ffn=256), "model_type": "mistral"},
    "qwen2": QWEN2,
    "qwen3": qwen3_config(),
}
#: Left padding of the batch (one sequence a row): unequal, so each step's mask is an array.
PADDING = [3, 0, 1]


def use(compiled: bool, lone: bool = True) -> None:
    fastpath.set_active(replace(fastpath.GENERIC, compiled_layers=compiled, compiled_lone=lone))


@pytest.fixture()
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Batch sizes of the layer calls that ran compiled halves."""
    seen: list[int] = []
    real = compiled_layers._Halves.run

    def run(self: Any, x: mx.array, mask: Any, cache: Any) -> mx.array:
        seen.append(x.shape[0])
        return real(self, x, mask, cache)

    monkeypatch.setattr(compiled_layers._Halves, "run", run)
    yield seen


def registered(name: str = "llama", compiled: bool = True) -> nn.Module:
    """A real model of ``CONFIGS[name]`` with its layers registered, under the CPU policy with the
    compiled halves on or off."""
    kernels.install()
    model = build_model(CONFIGS[name], seed=3)
    assert compiled_layers.install(model) == 2
    use(compiled)
    return model


def decode_logits(model: nn.Module, steps: int, padding: list[int] = PADDING) -> list[mx.array]:
    """Greedy decode steps of a batch (one prompt a row, left-padded as ``BatchGenerator`` pads them)."""
    cache = [BatchKVCache(padding) for _ in model.layers]
    prompt = mx.array([[(11 * r + 3 * j) % 250 + 1 for j in range(8)] for r in range(len(padding))])
    y = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)[:, None]
    out = []
    for _ in range(steps):
        logits = model(y, cache=cache)[:, -1]
        mx.eval(logits)
        out.append(logits)
        y = mx.argmax(logits, axis=-1)[:, None]
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compiled_halves_give_the_plain_layers_logits_byte_for_byte(name: str, policy: None, calls: list[int]) -> None:
    model = registered(name, compiled=False)
    plain = decode_logits(model, 6)
    assert calls == []
    use(True)
    compiled = decode_logits(model, 6)
    # The first step at a batch size runs plain (the kernels' first-use checks), the rest compiled.
    assert calls == [3] * 2 * 5
    assert all(kernels.bytes_equal(p, c) for p, c in zip(plain, compiled, strict=True))


def test_classic_decode_of_a_lone_sequence_runs_compiled_with_the_same_logits(policy: None, calls: list[int]) -> None:
    """Classic B = 1 decode is the chain bursts must reproduce: compiled, it keeps its bytes."""
    model = registered("llama-4bit", compiled=False)
    plain = decode_logits(model, 6, padding=[0])
    use(True)
    compiled = decode_logits(model, 6, padding=[0])
    assert calls == [1] * 2 * 5
    assert all(kernels.bytes_equal(p, c) for p, c in zip(plain, compiled, strict=True))


def test_only_decode_steps_at_wide_run_compiled(policy: None, calls: list[int]) -> None:
    model = registered()
    cache = [BatchKVCache([0, 0]) for _ in model.layers]
    for _ in range(3):  # prefill chunks of several tokens
        mx.eval(model(mx.ones((2, 4), dtype=mx.int32), cache=cache))
    assert calls == []
    with kernels.scoped(kernels.Level.NARROW):
        decode_logits(model, 3, padding=[0, 2])
    assert calls == []
    with kernels.stock():  # the raw peer in benchmarks
        decode_logits(model, 3, padding=[0, 2])
    assert calls == []
    use(True, lone=False)
    decode_logits(model, 4, padding=[0])
    assert calls == []
    decode_logits(model, 3, padding=[0, 2])
    assert calls == [2] * 2 * 2


def test_a_verdict_is_keyed_by_whether_classic_decode_runs_compiled(
    policy: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's chain runs through the engine's model, compiled where serving compiles it; a
    verdict measured on the plain chain is not reused for the compiled one."""
    from workers.exact.setup import probe_setup
    from workers.exact.verdict_store import pairing_fingerprint
    from workers.models.loading import load

    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    loaded = load(str(write_model(tmp_path / "m", CONFIGS["llama-4bit"], seed=3)))
    use(True)
    plain = probe_setup(loaded, "none", store=False).pairing
    assert plain["compiled_layers"] == 0  # nothing registered yet
    compiled_layers.install(loaded.model)
    compiled = probe_setup(loaded, "none", store=False).pairing
    assert compiled["compiled_layers"] == 2
    assert pairing_fingerprint(compiled) != pairing_fingerprint(plain)
    use(True, lone=False)
    assert probe_setup(loaded, "none", store=False).pairing["compiled_layers"] == 0


def test_new_plans_trace_the_halves_again(policy: None, calls: list[int]) -> None:
    """The halves read the kernel plans while tracing: a new plan must not replay an old trace."""
    model = registered()
    decode_logits(model, 3)
    halves = compiled_layers._layers[id(model.layers[0])]
    head = halves.head
    fastpath.generation += 1
    decode_logits(model, 3)
    assert halves.head is not head and halves.traced(3)


def test_a_layer_whose_halves_fail_keeps_mlx_lms_code(
    policy: None, calls: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = registered(compiled=False)
    plain = decode_logits(model, 5)

    def broken(*_: Any, **__: Any) -> Any:
        raise ValueError("cannot trace this layer")

    monkeypatch.setattr(compiled_layers, "_traced", broken)
    use(True)
    with caplog.at_level("WARNING", logger="mlx_batchd"):
        compiled = decode_logits(model, 5)
    assert all(kernels.bytes_equal(p, c) for p, c in zip(plain, compiled, strict=True))
    assert "not compiled: cannot trace this layer" in caplog.text
    assert id(model.layers[0]) not in compiled_layers._layers


def test_greedy_tokens_through_the_engine_are_unchanged(policy: None, calls: list[int]) -> None:
    model = build_model(CONFIGS["llama-4bit"], seed=5)
    prompts = [[5, 9, 14, 2], [7] * 9, [3, 1, 4, 1, 5, 9, 2]]
    use(False)
    plain = greedy_tokens(Engine(model, eos_token_ids=(), vocab_size=256, max_batch=4), prompts, 12)
    use(True)
    engine = Engine(model, eos_token_ids=(), vocab_size=256, max_batch=4)
    assert engine.compiled_layers == 2
    assert greedy_tokens(engine, prompts, 12) == plain
    assert 3 in calls
    unused: Any = {}
    assert engine_snapshot(engine, unused, unused, unused)["compiled_layers"] == 2  # stats say so
    use(False)
    assert engine_snapshot(engine, unused, unused, unused)["compiled_layers"] == 0


def test_a_model_that_goes_away_takes_its_halves_with_it(policy: None, calls: list[int]) -> None:
    model = registered()
    decode_logits(model, 3)
    ids = [id(layer) for layer in model.layers]
    assert calls and all(i in compiled_layers._layers for i in ids)
    gone = weakref.ref(model.layers[0])
    del model
    gc.collect()
    assert gone() is None and not any(i in compiled_layers._layers for i in ids)


@pytest.mark.parametrize("kind", ["draft-model-self", "prompt-lookup"])
def test_bursts_over_compiled_classic_decode_stay_byte_identical(
    policy: None, calls: list[int], tmp_path: Path, kind: str
) -> None:
    """The probe measures the compiled chain, the bursts it allows reproduce it, and it is the plain
    chain's output too."""
    from mlx_lm import load

    from tests.engine.test_bursts import EOS, EXACT_FOREVER, PROMPTS, VOCAB, job, run
    from tests.reference import probed_bursts
    from workers.engine.spec.drafters import DraftModel, PromptLookup

    target, _ = load(str(write_model(tmp_path / "t", llama_config(hidden=128, layers=2, ffn=256), seed=11)))
    kernels.measure_widths(target)
    jobs = [job(i, p, n=30) for i, p in enumerate(PROMPTS[:3])]
    use(False)
    want = {j.seq: run(Engine(target, eos_token_ids=EOS, vocab_size=VOCAB, max_batch=8), [j])[j.seq] for j in jobs}
    assert calls == []
    use(True)
    for j in jobs:
        engine = Engine(target, eos_token_ids=EOS, vocab_size=VOCAB, max_batch=8)
        drafter = DraftModel(target, name="self") if kind == "draft-model-self" else PromptLookup()
        probed_bursts(engine, target, drafter, EXACT_FOREVER, f"test+{drafter.name}", VOCAB, draws=4)
        assert run(engine, [j]) == {j.seq: want[j.seq]}
        assert engine.bursts.rounds > 0
    assert 1 in calls


def test_nothing_is_registered_where_mlx_compiles_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_DISABLE_COMPILE", "1")
    assert compiled_layers.install(build_model(CONFIGS["llama"], seed=3)) == 0
