"""``workers.kernels.mlxlm``, the one door to mlx-lm's private internals, against the installed mlx-lm.

Every accessor runs on a real ``BatchGenerator`` and tokenizer (the tiny model of ``conftest``), and
checks what it returns means what the engine takes it to mean; a release that renames or removes an
internal makes these tests fail with ``MlxLmChanged`` naming it. The last test removes each internal
from a real object and checks the error names it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib import import_module
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from mlx_lm.utils import load, load_tokenizer

from workers.kernels import mlxlm
from workers.kernels.arrays import as_int
from workers.models.loading import keep_leading_space
from workers.models.synthetic import llama_config


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> nn.Module:
    loaded = load(str(tiny_model))
    m: nn.Module = loaded[0]
    return m


@pytest.fixture()
def tokenizer(tiny_model: Path) -> Any:
    """A fresh tokenizer per test: ``keep_leading_space`` changes its detokenizer prototype."""
    return load_tokenizer(tiny_model)


def _decoding(model: nn.Module) -> tuple[BatchGenerator, int]:
    """A generator whose one sequence has been prefilled in chunks and reached the decode batch."""
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=2, prefill_step_size=4)
    (uid,) = gen.insert([list(range(5, 15))], max_tokens=[16])
    assert mlxlm.prefill_pending(gen) and uid not in mlxlm.decoding_uids(gen)
    for _ in range(10):
        gen.next()
        if uid in mlxlm.decoding_uids(gen):
            return gen, uid
    raise AssertionError("the sequence never reached the decode batch")


def test_batch_generator_accessors(model: nn.Module) -> None:
    idle = BatchGenerator(model)
    assert mlxlm.decode_batch_size(idle) == 0 and mlxlm.decoding_uids(idle) == []
    assert not mlxlm.prefill_pending(idle)

    gen, a = _decoding(model)
    assert mlxlm.decoding_uids(gen) == [a] and mlxlm.decode_batch_size(gen) == 1
    assert not mlxlm.prefill_pending(gen)
    (b,) = gen.insert([[20, 21, 22, 23, 24, 25]], max_tokens=[4])
    assert mlxlm.prefill_pending(gen) and b not in mlxlm.decoding_uids(gen)
    assert mlxlm.prefill_lengths(gen) == ([], [5])  # queued (all but the last token), none prefilling

    # The pending token is the one the next step hands out, with the row it was drawn from.
    token, row = mlxlm.pending_token(gen, a)
    mx.eval(token, row)
    assert row.shape == (model.args.vocab_size,)
    _, responses = gen.next()
    (r,) = [r for r in responses if r.uid == a]
    assert r.token == as_int(token)
    assert mx.array_equal(r.logprobs, row).item()

    # The public calls the engine pairs with it when a sequence leaves the batch (pause, bursts).
    in_cache = len(gen.extract_cache([a])[a][1])
    cache, tokens = gen.remove([a], return_prompt_caches=True)[a]
    assert len(tokens) == in_cache and cache[0].offset == in_cache
    assert a not in mlxlm.decoding_uids(gen)


def test_merge_caches_makes_one_row_per_cache(model: nn.Module) -> None:
    caches = []
    for n in (3, 5):
        c = make_prompt_cache(model)
        model(mx.array([list(range(7, 7 + n))]), cache=c)
        caches.append(c)
    merged = mlxlm.merge_caches(caches)
    assert len(merged) == len(caches[0])
    for layer, batch in enumerate(merged):
        for row, c in enumerate(caches):
            got, want = batch.extract(row), c[layer]
            assert got.offset == want.offset
            for a, b in ((got.keys, want.keys), (got.values, want.values)):
                assert mx.array_equal(a[..., : got.offset, :], b[..., : want.offset, :]).item()


def test_model_classes() -> None:
    config = llama_config(hidden=64, layers=1, ffn=128, heads=2, kv_heads=1)
    model_class, args_class = mlxlm.model_classes(config)
    assert isinstance(model_class(args_class.from_dict(config)), nn.Module)
    with pytest.raises(ValueError):  # what check_model reports as an unknown architecture
        mlxlm.model_classes({"model_type": "no_such_architecture"})


def test_detokenizer_prototype_and_the_continuation_class(tokenizer: Any) -> None:
    proto = mlxlm.detokenizer_prototype(tokenizer)
    assert type(proto) is BPEStreamingDetokenizer  # the synthetic byte-level tokenizer's
    assert type(tokenizer.detokenizer) is type(proto)  # each caller gets a copy of the prototype
    cls = mlxlm.continuation_bpe_class()
    assert issubclass(cls, BPEStreamingDetokenizer)
    keep_leading_space(tokenizer)
    assert type(mlxlm.detokenizer_prototype(tokenizer)) is cls
    d = tokenizer.detokenizer
    assert type(d) is cls
    for t in tokenizer.encode(" x = 1"):
        d.add_token(t)
    d.finalize()
    assert d.text == " x = 1"


@pytest.fixture()
def clear_continuation_class() -> Iterator[None]:
    mlxlm.continuation_bpe_class.cache_clear()
    yield
    mlxlm.continuation_bpe_class.cache_clear()


#: (accessor, the internal it reads, where that lives): each accessor's every private read.
INTERNALS = [
    ("decode_batch_size", "_generation_batch", "generator"),
    ("decoding_uids", "_generation_batch", "generator"),
    ("prefill_pending", "_unprocessed_sequences", "generator"),
    ("prefill_pending", "_prompt_batch", "generator"),
    ("pending_token", "_generation_batch", "generator"),
    ("pending_token", "_next_tokens", "decode batch"),
    ("pending_token", "_next_logprobs", "decode batch"),
    ("merge_caches", "_merge_caches", "mlx_lm.generate"),
    ("batch_classes", "GenerationBatch", "mlx_lm.generate"),
    ("batch_classes", "PromptProcessingBatch", "mlx_lm.generate"),
    ("model_classes", "_get_classes", "mlx_lm.utils"),
    ("detokenizer_prototype", "_detokenizer", "tokenizer"),
    ("continuation_bpe_class", "_maybe_trim_space", "BPEStreamingDetokenizer"),
    ("continuation_bpe_class", "_decode_bytes", "BPEStreamingDetokenizer"),
]


@pytest.mark.parametrize(("accessor", "name", "where"), INTERNALS, ids=[f"{a}-{n}" for a, n, _ in INTERNALS])
@pytest.mark.usefixtures("clear_continuation_class")
def test_a_missing_internal_is_reported_by_name(
    model: nn.Module, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, accessor: str, name: str, where: str
) -> None:
    gen, uid = _decoding(model)
    owners: dict[str, Any] = {
        "generator": gen,
        "decode batch": gen._generation_batch,
        "mlx_lm.generate": import_module("mlx_lm.generate"),
        "mlx_lm.utils": import_module("mlx_lm.utils"),
        "tokenizer": tokenizer,
        "BPEStreamingDetokenizer": BPEStreamingDetokenizer,
    }
    calls: dict[str, Callable[[], object]] = {
        "decode_batch_size": lambda: mlxlm.decode_batch_size(gen),
        "decoding_uids": lambda: mlxlm.decoding_uids(gen),
        "prefill_pending": lambda: mlxlm.prefill_pending(gen),
        "pending_token": lambda: mlxlm.pending_token(gen, uid),
        "merge_caches": lambda: mlxlm.merge_caches([make_prompt_cache(model)]),
        "batch_classes": mlxlm.batch_classes,
        "model_classes": lambda: mlxlm.model_classes(llama_config()),
        "detokenizer_prototype": lambda: mlxlm.detokenizer_prototype(tokenizer),
        "continuation_bpe_class": mlxlm.continuation_bpe_class,
    }
    calls[accessor]()  # present: it works
    mlxlm.continuation_bpe_class.cache_clear()  # so the call below looks again
    monkeypatch.delattr(owners[where], name)
    with pytest.raises(mlxlm.MlxLmChanged, match=rf"has no \S*\.{name}: workers/kernels/mlxlm.py was written against"):
        calls[accessor]()
