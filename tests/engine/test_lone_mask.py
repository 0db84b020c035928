"""A lone sequence's classic decode and the probe's chain compute the same attention.

On MLX CUDA a one-token attention with an array mask (mlx-lm's one-row ``BatchKVCache``) gives other
bytes than without one (the sequence's own ``KVCache``), which the CPU does not do; the tests that
need it inject it through ``workers.kernels.seam.divergence_seam`` and say so in their names.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

import workers.kernels.seam
from tests.reference import load_measured, perturb, probed_bursts
from workers import kernels
from workers.api import BurstSettings, Job, Level, Tokens
from workers.engine.engine import Engine
from workers.engine.spec.drafters import DraftModel
from workers.kernels import mlxlm, patches
from workers.models.synthetic import llama_config, write_model

VOCAB = 260
SETTINGS = BurstSettings(k=3, audit_fraction=0.0, profile_steps=0, min_rounds=10**9)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = write_model(tmp_path_factory.mktemp("lone") / "t", llama_config(hidden=128, layers=2, ffn=256), seed=21)
    return load_measured(Path(path))


@pytest.fixture(autouse=True)
def clean_kernel_state() -> Iterator[None]:
    yield
    workers.kernels.seam.divergence_seam = None
    kernels.set_process_level(Level.WIDE)


def _row(tokens: int, padding: int = 0, rows: int = 1) -> BatchKVCache:
    """A batch cache of ``rows`` rows holding ``tokens`` positions, ``padding`` of them left padding."""
    cache = BatchKVCache([padding] * rows)
    k = mx.ones((rows, 2, tokens, 8))
    cache.update_and_fetch(k, k)
    return cache


def test_a_one_row_unpadded_decode_step_has_no_mask_and_everything_else_keeps_mlx_lms() -> None:
    patches.install()
    single = KVCache()
    single.update_and_fetch(mx.ones((1, 2, 5, 8)), mx.ones((1, 2, 5, 8)))
    merged = mlxlm.merge_caches([[single]])[0]
    assert merged.make_mask(1) is None
    assert isinstance(merged.make_mask(3), mx.array | str)  # a block or a chunk: mlx-lm's mask
    assert isinstance(merged.make_mask(1, return_array=True), mx.array)
    padded = _row(6, padding=2)
    mask = padded.make_mask(1)
    assert isinstance(mask, mx.array) and not mask.all().item()  # the padding stays masked
    assert isinstance(_row(6, rows=2).make_mask(1), mx.array)
    padded.left_padding = mx.array([0])  # a new padding array is read again, not taken from the memo
    assert padded.make_mask(1) is None
    padded.left_padding = mx.array([1])
    assert isinstance(padded.make_mask(1), mx.array)
    with patches.stock():  # the raw peer runs mlx-lm's own
        assert isinstance(merged.make_mask(1), mx.array)
    assert merged.make_mask(1) is None


def _masked_attention_differs(kind: str, out: mx.array, rows: int) -> mx.array:
    """Injected at the seam: a one-query attention call given an array mask comes out one ulp off,
    as MLX CUDA's does against the same call without a mask."""
    call = workers.kernels.seam.seam_call
    if kind == "attention" and rows == 1 and call is not None and isinstance(call.mask, mx.array):
        return perturb(out)
    return out


def _generate(engine: Engine, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    engine.submit(Job(seq=1, prompt=prompt, max_tokens=n))
    while engine.has_work:
        out += [t for e in engine.step() if isinstance(e, Tokens) for t in e.tokens]
    return out


def _bursting(target: Any) -> tuple[Engine, Any]:
    engine = Engine(target, eos_token_ids=(), vocab_size=VOCAB, max_batch=4)
    verdict = probed_bursts(engine, target, DraftModel(target, name="self"), SETTINGS, "lone+self", VOCAB, draws=4)
    return engine, verdict


PROMPT = [3, 14, 15, 92, 65, 35]


def test_injected_masked_attention_divergence_bursts_match_the_engines_classic_decode(target: Any) -> None:
    """With a one-row batch decoding unmasked, the chain the probe checks is the engine's own decode:
    bursts run and give the engine's classic tokens byte for byte, divergence injected or not."""
    workers.kernels.seam.divergence_seam = _masked_attention_differs
    classic = _generate(Engine(target, eos_token_ids=(), vocab_size=VOCAB, max_batch=4), PROMPT, 24)
    engine, verdict = _bursting(target)
    assert verdict.level == "wide" and verdict.exact, verdict.reason
    assert _generate(engine, PROMPT, 24) == classic
    assert engine.bursts.rounds > 0 and engine.bursts.accepted > 0


def test_injected_masked_attention_divergence_without_lone_mask_is_declined(
    target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fail closed: where the engine's classic decode (masked) computes other bytes than the
    sequence's own cache, the probe's chain is the engine's decode, so the verify (on the burst's
    own cache) never matches it and no burst runs; the tokens are classic decode's."""
    patches.install()
    monkeypatch.setattr(BatchKVCache, "make_mask", BatchKVCache.make_mask.__wrapped__)
    workers.kernels.seam.divergence_seam = _masked_attention_differs
    classic = _generate(Engine(target, eos_token_ids=(), vocab_size=VOCAB, max_batch=4), PROMPT, 24)
    engine, verdict = _bursting(target)
    assert verdict.level is None and not verdict.exact
    assert all(not lr.exact for lr in verdict.ladder)
    assert _generate(engine, PROMPT, 24) == classic
    assert engine.bursts.rounds == 0
