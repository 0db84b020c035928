"""Per-query attention in groups: consecutive queries of a verify block share one causal attention
call where that is measured, on this backend and shape, to give each query the bytes of decode's
one-query call (``workers.kernels.attention``). MLX's CPU kernels give every query the same bytes whatever
the call, so the divergence a backend may show for multi-query calls is injected at the named seam
``workers.kernels.seam.divergence_seam``; the tests that do so say it in their names."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, make_prompt_cache

import workers.kernels.seam
from tests.reference import load_measured
from workers.api import Level
from workers.engine.engine import Engine
from workers.kernels import attention, bytes_equal, layout, sdpa_rows
from workers.kernels.attention import MAX_GROUP, SPLIT, group_width, spans
from workers.models.synthetic import PRESETS, write_model

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
    assert group_width(scaled_dot_product_attention, q, k, 0.125) == (MAX_GROUP, False)  # no project kernel here


def test_injected_multi_query_divergence_makes_the_width_one() -> None:
    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        return out + 1e-2 if kind == "attention" and rows > 1 else out

    workers.kernels.seam.divergence_seam = seam
    q, k = _queries_keys()
    assert group_width(scaled_dot_product_attention, q, k, 0.125) == (1, False)


def test_injected_divergence_past_three_queries_makes_the_width_three() -> None:
    """As on MLX CUDA, whose vector kernel takes fewer than 4 queries."""

    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        return out * 1.5 if kind == "attention" and rows > 3 else out

    workers.kernels.seam.divergence_seam = seam
    q, k = _queries_keys()
    assert group_width(scaled_dot_product_attention, q, k, 0.125) == (3, False)


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
    workers.kernels.seam.divergence_seam = count
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


#: The caches' growth step in the cache-update test: a buffer edge reached by a short prompt.
SMALL_STEP = 256


@pytest.mark.parametrize(
    ("level", "prompt_len", "updates_per_layer"),
    [
        (Level.PER_QUERY, 40, 1),  # room in the buffer (SMALL_STEP keys): one update for the block
        (Level.MIRRORED, 40, 1),
        (Level.PER_QUERY, SMALL_STEP - 2, 5),  # the block would grow the buffer: one-token updates
        (Level.PER_QUERY_1, 40, 5),  # exact by construction: decode's own one-token updates
    ],
)
def test_a_block_takes_one_cache_update_where_the_buffer_has_room(
    llama: Path, monkeypatch: pytest.MonkeyPatch, level: Level, prompt_len: int, updates_per_layer: int
) -> None:
    """Each query's view is then a prefix of the block's view in the same buffer; the logits are
    byte-identical to one-token updates (``per-query-1``). The caches grow by ``SMALL_STEP`` here
    (``LAYOUT_STEP`` elsewhere): the same branch at a 254-token prompt instead of 4,094."""
    monkeypatch.setattr(layout, "LAYOUT_STEP", SMALL_STEP)
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


# --------------------------------------------------------------------------- the project's kernel


def _one_query_calls(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Stand-in for ``sdpa_rows.attend`` (its CUDA kernels cannot run on this CPU): what the kernel is
    to reproduce, each query's own one-query call over the keys before it and its own."""
    n, total = queries.shape[2], keys.shape[2]
    outs = []
    for i in range(n):
        end = total - n + 1 + i
        q = queries[:, :, i : i + 1]
        outs.append(scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], None, scale=scale, mask=None))
    return mx.concatenate(outs, axis=2)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The kernel taken on this CPU, launched through the stand-in; returns the queries of each launch."""
    calls: list[int] = []

    def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        calls.append(queries.shape[2])
        return _one_query_calls(queries, keys, values, scale)

    monkeypatch.setattr(sdpa_rows, "takes", lambda *_: True)
    monkeypatch.setattr(sdpa_rows, "attend", attend)
    monkeypatch.setattr(attention, "_widths", {})  # measured afresh, with the kernel on offer
    return calls


def test_spans_leave_a_query_alone_where_decode_may_have_run_another_kernel() -> None:
    assert spans([254, 255, 256, 257, 258], 8, 256) == [(0, 1), (2, 2), (3, 4)]
    assert spans([254, 255, 256, 257, 258], 8) == [(0, 4)]
    assert spans([255, 256], 8, 256) == [(0, 0), (1, 1)]


def test_a_kernel_that_reproduces_one_query_calls_serves_every_group(kernel_calls: list[int]) -> None:
    q, k = _queries_keys()
    assert group_width(scaled_dot_product_attention, q, k, 0.125) == (MAX_GROUP, True)
    assert kernel_calls and max(kernel_calls) == MAX_GROUP


def test_a_kernel_one_rounding_step_off_is_not_used(kernel_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by one bfloat16 step in one element: MLX's own grouped calls are measured instead."""

    def off(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        out = _one_query_calls(queries, keys, values, scale)
        bits = out.view(mx.uint16)
        return mx.concatenate([(bits[..., :1] + 1).view(out.dtype), out[..., 1:]], axis=-1)

    monkeypatch.setattr(sdpa_rows, "attend", off)
    q, k = _queries_keys()
    assert group_width(scaled_dot_product_attention, q, k, 0.125) == (MAX_GROUP, False)


def test_a_kernel_that_fails_here_is_not_used(kernel_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object) -> mx.array:
        raise RuntimeError("stand-in: the kernel did not build")

    monkeypatch.setattr(sdpa_rows, "attend", broken)
    q, k = _queries_keys()
    assert group_width(scaled_dot_product_attention, q, k, 0.125) == (MAX_GROUP, False)


def test_a_verify_block_through_the_kernel_equals_one_call_per_query(llama: Path, kernel_calls: list[int]) -> None:
    """The block's queries reach the kernel in groups (a multiple of 256 keys and of 1,024 alone, as
    decode may have run other kernels there); the logits are byte-identical to ``per-query-1``'s."""
    model = load_measured(llama)
    engine = Engine(model, eos_token_ids=(0,), vocab_size=260)
    blocks = {}
    for prompt_len, want in ((40, [5]), (2 * 256 - 2, [1, 3])):  # 511 | 512 alone | 513 .. 515
        prompt = mx.array([[(7 * i) % 250 + 3 for i in range(prompt_len)]])
        for lv in (Level.PER_QUERY_1, Level.PER_QUERY, Level.PER_QUERY):
            cache = make_prompt_cache(model)
            mx.eval(engine.forward(prompt, cache))
            kernel_calls.clear()
            with engine.pinned(lv, "verify"):
                blocks[lv] = engine.forward(mx.array([[4, 5, 6, 7, 8]]), cache)
                mx.eval(blocks[lv])
        assert kernel_calls == [n for n in want if n > 1] * len(model.model.layers)
        assert bytes_equal(blocks[Level.PER_QUERY], blocks[Level.PER_QUERY_1])
