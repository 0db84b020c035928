"""Per-query attention in groups: consecutive queries of a verify block share one causal attention
call where that is measured, on this backend and shape, to give each query the bytes of decode's
one-query call (``workers.attention``). MLX's CPU kernels give every query the same bytes whatever
the call, so the divergence a backend may show for multi-query calls is injected at the named seam
``workers.seam.divergence_seam``; the tests that do so say it in their names."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, make_prompt_cache

import workers.seam
from tests.reference import load_measured
from workers import attention
from workers.attention import MAX_GROUP, SPLIT, group_width, spans
from workers.engine import Engine
from workers.kernels import LAYOUT_STEP, Level, bytes_equal
from workers.synthetic import PRESETS, write_model

pytestmark = pytest.mark.usefixtures("clean_kernel_state")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("grouped") / "tiny-llama", PRESETS["tiny-llama"], seed=11)


def test_spans_group_consecutive_queries_and_never_span_a_strategy_change() -> None:
    assert spans([10, 11, 12, 13, 14], 3) == [(0, 2), (3, 4)]
    assert spans([10, 11, 12, 13, 14], 1) == [(i, i) for i in range(5)]
    assert spans([10, 11, 12, 13, 14], 8) == [(0, 4)]
    # Decode saw 1,022 .. 1,026 keys: 1,024 is a strategy change's edge on both sides, so it is alone.
    around = [SPLIT - 2, SPLIT - 1, SPLIT, SPLIT + 1, SPLIT + 2]
    assert spans(around, 8) == [(0, 1), (2, 2), (3, 4)]
    assert spans([2 * SPLIT + 1, 2 * SPLIT + 2], 8) == [(0, 1)]


def _queries_keys() -> tuple[mx.array, mx.array]:
    return mx.zeros((1, 8, 5, 64), dtype=mx.bfloat16), mx.zeros((1, 2, 40, 64), dtype=mx.bfloat16)


def test_the_width_is_measured_here_cpu_groups_every_query_of_a_block() -> None:
    q, k = _queries_keys()
    assert group_width(scaled_dot_product_attention, q, k, 0.125) == MAX_GROUP


def test_injected_multi_query_divergence_makes_the_width_one() -> None:
    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        return out + 1e-2 if kind == "attention" and rows > 1 else out

    workers.seam.divergence_seam = seam
    q, k = _queries_keys()
    assert group_width(scaled_dot_product_attention, q, k, 0.125) == 1


def test_injected_divergence_past_three_queries_makes_the_width_three() -> None:
    """As on MLX CUDA, whose vector kernel takes fewer than 4 queries."""

    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        return out * 1.5 if kind == "attention" and rows > 3 else out

    workers.seam.divergence_seam = seam
    q, k = _queries_keys()
    assert group_width(scaled_dot_product_attention, q, k, 0.125) == 3


@pytest.mark.parametrize("level", [Level.PER_QUERY, Level.MIRRORED, Level.PER_QUERY_1])
def test_a_verify_block_in_groups_equals_one_call_per_query(llama: Path, level: Level) -> None:
    """Every level that runs attention per query groups it except ``per-query-1`` (exact by
    construction), and a grouped block's logits are byte-identical to the block at one query per
    call (``per-query-1``), at a context whose block crosses 1,024 keys."""
    model = load_measured(llama)
    engine = Engine(model, eos_token_ids=(0,), vocab_size=260)
    calls: list[int] = []

    def count(kind: str, out: mx.array, rows: int) -> mx.array:
        if kind == "attention":
            calls.append(rows)
        return out

    blocks = {}
    prompt = mx.array([[(7 * i) % 250 + 3 for i in range(SPLIT - 2)]])
    workers.seam.divergence_seam = count
    for lv in (Level.PER_QUERY_1, level, level):  # the second time the width is known: its calls only
        cache = make_prompt_cache(model)
        mx.eval(engine.forward(prompt, cache))
        calls.clear()
        with engine.pinned(lv, "verify"):
            blocks[lv] = engine.forward(mx.array([[4, 5, 6, 7, 8]]), cache)
            mx.eval(blocks[lv])
    layers = len(model.model.layers)
    # Decode saw 1,023 .. 1,027 keys: 1,023 | 1,024 alone | 1,025 .. 1,027.
    want = [1] * 5 * layers if level is Level.PER_QUERY_1 else [1, 1, 3] * layers
    assert calls == want
    assert bytes_equal(blocks[level], blocks[Level.PER_QUERY_1])
    attention._widths.clear()


@pytest.mark.parametrize(
    ("level", "prompt_len", "updates_per_layer"),
    [
        (Level.PER_QUERY, 40, 1),  # room in the buffer (LAYOUT_STEP keys): one update for the block
        (Level.MIRRORED, 40, 1),
        (Level.PER_QUERY, LAYOUT_STEP - 2, 5),  # the block would grow the buffer: one-token updates
        (Level.PER_QUERY_1, 40, 5),  # exact by construction: decode's own one-token updates
    ],
)
def test_a_block_takes_one_cache_update_where_the_buffer_has_room(
    llama: Path, monkeypatch: pytest.MonkeyPatch, level: Level, prompt_len: int, updates_per_layer: int
) -> None:
    """Each query's view is then a prefix of the block's view in the same buffer; the logits are
    byte-identical to one-token updates (``per-query-1``)."""
    model = load_measured(llama)
    engine = Engine(model, eos_token_ids=(0,), vocab_size=260)
    prompt = mx.array([[(7 * i) % 250 + 3 for i in range(prompt_len)]])
    update = KVCache.update_and_fetch
    calls: list[int] = []

    def counted(self: KVCache, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        calls.append(keys.shape[2])
        return update(self, keys, values)

    blocks = {}
    for lv in (Level.PER_QUERY_1, level):
        cache = make_prompt_cache(model)
        mx.eval(engine.forward(prompt, cache))
        monkeypatch.setattr(KVCache, "update_and_fetch", counted)
        calls.clear()
        with engine.pinned(lv, "verify"):
            blocks[lv] = engine.forward(mx.array([[4, 5, 6, 7, 8]]), cache)
            mx.eval(blocks[lv])
        monkeypatch.setattr(KVCache, "update_and_fetch", update)
    assert len(calls) == updates_per_layer * len(model.model.layers)
    assert bytes_equal(blocks[level], blocks[Level.PER_QUERY_1])
