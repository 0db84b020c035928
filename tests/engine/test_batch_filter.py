"""``workers.kernels.batch_filter``: dropping finished sequences reads every layer's padding back in one go,
and leaves the batch exactly as mlx-lm's own ``filter`` does.

Real ``BatchGenerator`` runs on the tiny model of ``conftest``: prompts of different lengths (so the
batch caches carry left padding that a filter trims) and budgets that end the sequences at different
steps (so the decode batch is filtered several times), with the project's patches and on stock
mlx-lm, compared token for token and cache byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load

from workers.kernels import batch_filter, install, mlxlm, stock

PROMPTS = [[5, 6, 7], list(range(10, 19)), [30, 31, 32, 33, 34], list(range(40, 53))]
#: The longest prompt (no padding) ends first, then the next longest: each filter trims shared padding.
BUDGETS = [12, 6, 9, 2]


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> nn.Module:
    install()
    m: nn.Module = load(str(tiny_model))[0]
    return m


def run(model: nn.Module) -> tuple[dict[int, list[int]], list[list[bytes]]]:
    """Every sequence's tokens, and the decode batch's cache (keys, values, offsets, padding) as bytes
    after each step in which a sequence finished."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    uids = gen.insert(PROMPTS, max_tokens=BUDGETS)
    out: dict[int, list[int]] = {u: [] for u in uids}
    snapshots = []
    while True:
        _, responses = gen.next()
        if not responses and not mlxlm.prefill_pending(gen) and not mlxlm.decoding_uids(gen):
            break
        for r in responses:
            out[r.uid].append(r.token)
        if any(r.finish_reason for r in responses) and mlxlm.decoding_uids(gen):
            batch = gen._generation_batch
            state = []
            for c in batch.prompt_cache:
                keys, values = c.keys_and_values()
                state += [bytes(memoryview(a)) for a in (keys, values, c.offset, c.left_padding)]
                state.append(str(c._idx).encode())
            snapshots.append(state)
    gen.close()
    return out, snapshots


def test_the_batch_after_each_filter_is_mlx_lms_own(model: nn.Module) -> None:
    patched, patched_states = run(model)
    with stock():
        assert mlxlm.batch_classes()[0].filter.__name__ == "filter" and not hasattr(
            mlxlm.batch_classes()[0].filter, "__wrapped__"
        )
        plain, plain_states = run(model)
    assert patched == plain and [len(t) for t in patched.values()] == BUDGETS
    assert len(patched_states) == 3  # filtered three times, each trimming shared padding
    assert patched_states == plain_states


@pytest.fixture()
def spied(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Whether each padding lookup a layer's ``filter`` made was answered from the batch's one
    evaluation (``True``) or went to the device (``False``)."""
    hits: list[bool] = []
    original = batch_filter._Gathered.__getitem__

    def getitem(self: Any, index: Any) -> mx.array:
        hits.append(index is self.keep)
        return original(self, index)

    monkeypatch.setattr(batch_filter._Gathered, "__getitem__", getitem)
    yield hits


def test_every_layer_takes_its_padding_from_the_one_evaluation(model: nn.Module, spied: list[bool]) -> None:
    run(model)
    layers = len(model.layers)
    assert spied and len(spied) % layers == 0 and all(spied)


def test_a_stand_in_is_gone_after_the_filter_even_when_mlx_lm_raises(model: nn.Module) -> None:
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    gen.insert(PROMPTS[:2], max_tokens=[8, 8])
    while len(mlxlm.decoding_uids(gen)) < 2:
        gen.next()
    batch = gen._generation_batch
    before = [c.left_padding for c in batch.prompt_cache]

    def broken(self: Any, keep: list[int]) -> None:
        raise RuntimeError("mlx-lm failed mid-filter")

    with pytest.raises(RuntimeError, match="mid-filter"):
        batch_filter.filtered(broken)(batch, [1])
    assert all(c.left_padding is b for c, b in zip(batch.prompt_cache, before))
    gen.close()
