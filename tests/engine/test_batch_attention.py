"""Batched decode's attention through the masked one-query kernel (``workers.kernels.batch_attention``).

The CUDA kernel cannot run here (its numbers are tests/gpu's); what runs here is which calls reach it and
what the engine does with its output and with a kernel that is wrong. The launch is replaced by stand-ins
named as such: ``per_sequence`` computes each sequence's attention over only its own unmasked keys with
MLX's unmasked one-query call (what the kernel computes, by another route than the masked call it replaces).
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest

from tests.helpers.fastpath import greedy_tokens
from tests.helpers.fastpath import policy as policy
from workers.api import Level
from workers.engine.engine import Engine
from workers.kernels import batch_attention, fastpath, levels
from workers.models.loading import load

pytestmark = pytest.mark.usefixtures("clean_kernel_state", "policy")

PROMPTS = [[5 + i] * (3 + 4 * i) for i in range(3)]  # three lengths: every row of the mask differs


def per_sequence(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float) -> mx.array:
    """Stand-in: sequence b's query over the keys its mask row keeps (a contiguous suffix under left padding)."""
    rows = mask.reshape(mask.shape[0], -1)
    outs = []
    for b in range(queries.shape[0]):
        start = keys.shape[2] - int(rows[b].astype(mx.int32).sum().item())
        k, v = keys[b : b + 1, :, start:], values[b : b + 1, :, start:]
        outs.append(mx.fast.scaled_dot_product_attention(queries[b : b + 1], k, v, scale=scale))
    return mx.concatenate(outs, axis=0)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """The kernel switched on with the ``per_sequence`` stand-in; yields each launch's (B, keys) shape."""
    seen: list[tuple[int, ...]] = []

    def stand_in(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float) -> mx.array:
        seen.append((queries.shape[0], keys.shape[2]))
        return per_sequence(queries, keys, values, mask, scale)

    monkeypatch.setenv("MLX_BATCHD_BATCH_ATTENTION", "1")
    monkeypatch.setattr(batch_attention, "launch_seam", stand_in)
    monkeypatch.setattr(batch_attention, "_checked", {})
    yield seen


def _tokens(prompts: list[list[int]], n: int = 6, switched_on: bool = True) -> dict[int, list[int]]:
    import os

    os.environ["MLX_BATCHD_BATCH_ATTENTION"] = "1" if switched_on else "0"
    loaded = load("demo", widths=False)
    fastpath.set_active(fastpath.CUDA)
    engine = Engine(
        loaded.model, calibration="background", eos_token_ids=(), vocab_size=loaded.info.vocab_size, max_batch=4
    )
    return greedy_tokens(engine, prompts, n)


def test_batched_decode_steps_reach_it_and_keep_the_engine_s_tokens(launches: list[tuple[int, ...]]) -> None:
    with_kernel = _tokens(PROMPTS)
    assert launches and {b for b, _ in launches} == {3}  # decode steps of the three sequences
    assert len({n for _, n in launches}) > 1  # the keys grow a step
    launches.clear()
    assert _tokens(PROMPTS, switched_on=False) == with_kernel and launches == []


def test_it_is_off_unless_switched_on_and_never_for_a_lone_sequence(
    launches: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _tokens([PROMPTS[0]])
    assert launches == []  # one sequence: MLX's unmasked one-query kernel already runs
    _tokens(PROMPTS, switched_on=False)
    assert launches == []


def test_it_takes_only_wide_decode_calls_with_a_boolean_row_mask(launches: list[tuple[int, ...]]) -> None:
    q = mx.zeros((3, 4, 1, 64))
    k = mx.zeros((3, 2, 9, 64))
    rows = mx.ones((3, 1, 1, 9), dtype=mx.bool_)
    assert batch_attention.takes(q, k, k, rows, {})
    assert not batch_attention.takes(q, k, k, rows, {"sinks": mx.zeros((4,))})
    assert not batch_attention.takes(q, k, k, rows.astype(mx.float32), {})  # an additive mask
    assert not batch_attention.takes(q, k, k, "causal", {})
    assert not batch_attention.takes(mx.zeros((3, 4, 2, 64)), k, k, mx.ones((3, 1, 2, 9), dtype=mx.bool_), {})
    assert not batch_attention.takes(
        mx.zeros((3, 4, 1, 80)), mx.zeros((3, 2, 9, 80)), mx.zeros((3, 2, 9, 80)), rows, {}
    )
    with levels.scoped(Level.PER_QUERY):
        assert not batch_attention.takes(q, k, k, rows, {})


def test_a_kernel_off_from_mlx_at_its_first_call_is_not_used_for_those_heads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Fail closed: the first call on a (heads, KV heads, head dim, dtype) compares with MLX's masked call."""
    calls: list[str] = []

    def off_stand_in(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float) -> mx.array:
        calls.append("off")
        return per_sequence(queries, keys, values, mask, scale)[::-1]  # the sequences' outputs swapped

    monkeypatch.setenv("MLX_BATCHD_BATCH_ATTENTION", "1")
    monkeypatch.setattr(batch_attention, "launch_seam", off_stand_in)
    monkeypatch.setattr(batch_attention, "_checked", {})
    q = mx.random.normal((3, 4, 1, 64), key=mx.random.key(1))
    k = mx.random.normal((3, 2, 9, 64), key=mx.random.key(2))
    v = mx.random.normal((3, 2, 9, 64), key=mx.random.key(3))
    mask = mx.arange(9)[None, None, None, :] >= mx.array([0, 3, 6])[:, None, None, None]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    for _ in range(2):
        assert mx.array_equal(batch_attention.attend(q, k, v, mask, 0.125), want)
    assert calls == ["off"] and batch_attention._checked == {(4, 2, 64, mx.float32): False}
    assert "MLX's is used there" in caplog.text
    monkeypatch.setattr(batch_attention, "launch_seam", per_sequence)
    monkeypatch.setattr(batch_attention, "_checked", {})
    got = batch_attention.attend(q, k, v, mask, 0.125)
    assert batch_attention._checked == {(4, 2, 64, mx.float32): True}
    assert mx.allclose(got, want, atol=1e-5)


def test_its_source_is_mlx_s_one_pass_kernel_with_its_edits_and_refuses_text_that_moved() -> None:
    from workers.kernels import sdpa_source

    assert batch_attention.SOURCE == batch_attention._edited(sdpa_source.ONE_PASS)
    assert "if (!row[i])" in batch_attention.SOURCE and "q_seq_idx" not in batch_attention.SOURCE
    with pytest.raises(RuntimeError, match="no longer holds"):
        batch_attention._edited(sdpa_source.ONE_PASS.replace("const int kTotal", "const int kAll"))
