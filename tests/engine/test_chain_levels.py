"""The rungs that pin classic decode too: ``padded`` (every projection of the lone sequence's
forwards, classic decode's included, on ``PAD_ROWS`` rows) and ``rowwise`` (every one through the
project's row-exact kernel), so a verify block and the chain make the same kernel calls per row.

MLX's CPU kernels are row-exact, so the divergence these rungs exist for (MLX CUDA's one-row kernel
differs from its batched one) is injected at the named seam ``workers.kernels.seam.divergence_seam``;
every test that does so says it in its name. The CUDA ladder order is forced with
``fastpath.set_active(fastpath.CUDA)``; the row-exact kernel cannot run on this CPU, so ``rowwise``
runs its plain-MLX reference (``MLX_BATCHD_ROWKERNEL=reference``, the same switch the CUDA kernel
sits behind).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

import workers.kernels.seam
from tests.reference import load_measured, probed_bursts
from workers.api import BurstSettings, Job, Level, ProbePolicy, Tokens
from workers.engine.engine import Engine
from workers.engine.spec.drafters import DraftModel
from workers.exact.probe import make_draws, probe
from workers.kernels import PAD_ROWS, bytes_equal, fastpath, qmv_rows, scoped
from workers.models.synthetic import PRESETS, write_model

VOCAB = 260
pytestmark = pytest.mark.usefixtures("clean_kernel_state")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("padded") / "tiny-llama", PRESETS["tiny-llama"], seed=7)


@pytest.fixture
def cuda_ladder(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CUDA backend's switch (ladder order, flattened projections) on this CPU, row-exact
    kernel off (tests of ``rowwise`` turn its reference on)."""
    monkeypatch.setenv("MLX_BATCHD_ROWKERNEL", "off")
    fastpath.set_active(fastpath.CUDA)
    try:
        yield
    finally:
        fastpath.set_active(None)


#: (level, MLX_BATCHD_ROWKERNEL): each chain-pinning rung with the row-exact kernel's switch set so
#: that it is the first rung after wide on the CUDA ladder.
CHAIN_RUNGS = [(Level.PADDED, "off"), (Level.ROWWISE, "reference")]


def _one_row_kernel_differs(kind: str, out: mx.array, rows: int) -> mx.array:
    """Injected: a projection computed on one row comes out different from the same row computed
    among others (negated, so that any one-row call reaching the output changes the tokens)."""
    return -out if kind == "projection" and rows == 1 else out


def test_padded_runs_every_projection_on_pad_rows_and_keeps_the_real_rows_exact(llama: Path) -> None:
    """Chunks of ``PAD_ROWS`` (a 21-token forward is two calls, the second padded), each call on
    exactly ``PAD_ROWS`` rows, and on this row-exact CPU the logits are byte-equal to wide's."""
    model = load_measured(llama)
    tokens = mx.array([[(7 * i) % 250 + 3 for i in range(21)]])
    wide = model(tokens, cache=make_prompt_cache(model))
    rows_seen: list[int] = []

    def count(kind: str, out: mx.array, rows: int) -> mx.array:
        if kind == "projection":
            rows_seen.append(rows)
        return out

    workers.kernels.seam.divergence_seam = count
    with scoped(Level.PADDED):
        padded = model(tokens, cache=make_prompt_cache(model))
        one = model(tokens[:, :1], cache=make_prompt_cache(model))
    mx.eval(wide, padded, one)
    assert padded.shape == wide.shape and bytes_equal(padded, wide)
    assert bytes_equal(one[0, 0], wide[0, 0])
    assert rows_seen and set(rows_seen) == {PAD_ROWS}
    projections = len(rows_seen) // 3  # two calls per projection for 21 rows, one for 1 row
    assert len(rows_seen) == 3 * projections


@pytest.mark.usefixtures("cuda_ladder")
@pytest.mark.parametrize(("level", "rowkernel_switch"), CHAIN_RUNGS)
def test_injected_one_row_divergence_is_exact_at_the_rung_because_the_chain_runs_at_it_too(
    llama: Path, level: Level, rowkernel_switch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected: one-row projection calls differ (MLX CUDA's matrix-vector kernel against its batched
    one). Wide differs (the chain's calls are one row, the block's are not); at padded both run
    ``PAD_ROWS`` rows per call, at rowwise both go through the project's kernel, so every draw is exact."""
    monkeypatch.setenv("MLX_BATCHD_ROWKERNEL", rowkernel_switch)
    monkeypatch.setattr(qmv_rows, "usable", lambda: False)  # this test is about the chain-pinning rungs
    model = load_measured(llama)
    workers.kernels.seam.divergence_seam = _one_row_kernel_differs
    draws = make_draws(3, VOCAB, 4096, None)
    verdict = probe(model, lambda: make_prompt_cache(model), {"test": level.value}, draws, 3, policy=ProbePolicy())
    assert [(lr.level, lr.exact) for lr in verdict.ladder] == [("wide", False), (level.value, True)]
    assert (verdict.level, verdict.exact) == (level.value, True), verdict.reason
    assert len(verdict.ladder[1].draws) == len(draws)


def _generate(engine: Engine, prompt: list[int], n: int) -> list[int]:
    engine.submit(Job(seq=1, prompt=prompt, max_tokens=n))
    out: list[int] = []
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, Tokens):
                out += event.tokens
    return out


def _pinned_engine(model: Any, level: Level = Level.PADDED, policy: ProbePolicy | None = None) -> Engine:
    """An engine whose drafter is the target itself, gated by a real probe (verdict: ``level``)."""
    engine = Engine(model, eos_token_ids=(0,), vocab_size=VOCAB, max_batch=8)
    settings = BurstSettings(k=3, audit_fraction=1.0, profile_steps=0, min_rounds=10**9)
    drafter = DraftModel(model, name="self")
    verdict = probed_bursts(engine, model, drafter, settings, f"{level}+self", VOCAB, draws=4, policy=policy)
    assert verdict.level == level.value, verdict.reason
    return engine


@pytest.mark.usefixtures("cuda_ladder")
@pytest.mark.parametrize(("level", "rowkernel_switch"), CHAIN_RUNGS)
def test_injected_one_row_divergence_bursts_at_the_rung_emit_its_classic_decode(
    llama: Path, level: Level, rowkernel_switch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected: one-row projection calls differ. With the verdict at a rung that pins the chain, the
    lone sequence's classic steps run at it too, so bursts emit exactly what that classic decode
    emits, every round audited clean; classic decode left at one-row calls would emit something else."""
    monkeypatch.setenv("MLX_BATCHD_ROWKERNEL", rowkernel_switch)
    monkeypatch.setattr(qmv_rows, "usable", lambda: False)  # this test is about the chain-pinning rungs
    model = load_measured(llama)
    workers.kernels.seam.divergence_seam = _one_row_kernel_differs
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]

    classic = _pinned_engine(model, level)
    classic.runner.wants = lambda live, gate=None: False  # type: ignore[method-assign]  # never burst
    reference = _generate(classic, prompt, 30)
    assert _classic_forwards(classic, level) > 0

    unpinned = _generate(Engine(model, eos_token_ids=(0,), vocab_size=VOCAB), prompt, 30)
    assert unpinned != reference  # the injected one-row kernel reaches the tokens

    engine = _pinned_engine(model, level)
    assert _generate(engine, prompt, 30) == reference
    summary = engine.burst_summary()
    assert summary["rounds"] > 0 and summary["audits"] == summary["rounds"] and summary["audit_failures"] == 0
    assert engine.ledger.snapshot()["collateral_forwards"] == 0


@pytest.mark.usefixtures("cuda_ladder")
def test_padded_classic_steps_are_the_lone_sequences_only(llama: Path) -> None:
    """With padded pinned by the operator: two sequences decoding together run plain batched steps;
    once one is left alone its classic steps are pinned at padded (counted as ``classic``), and
    batched work is never collateral."""
    model = load_measured(llama)
    engine = _pinned_engine(model, Level.PADDED, ProbePolicy(pinned_level=Level.PADDED))
    engine.runner.wants = lambda live, gate=None: False  # type: ignore[method-assign]
    engine.submit(Job(seq=1, prompt=[5, 6, 7], max_tokens=4))
    engine.submit(Job(seq=2, prompt=[8, 9, 10], max_tokens=40))
    while engine.batch_size() < 2:
        engine.step()
    while engine.active > 1:
        engine.step()
    before = _classic_forwards(engine)
    steps_alone = 0
    while engine.has_work:
        engine.step()
        steps_alone += 1
    assert before == 0
    assert steps_alone > 10 and _classic_forwards(engine) >= steps_alone - 1
    assert engine.ledger.snapshot()["collateral_forwards"] == 0


def _classic_forwards(engine: Engine, level: Level = Level.PADDED) -> int:
    counts = engine.ledger.requested.get((level.value, "classic"))
    return 0 if counts is None else counts.forwards


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_rowwise_projections_agree_with_mlx_and_chunk_long_blocks(
    llama: Path, dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At rowwise every covered projection goes through ``rowkernel.project`` (its reference here):
    quantized, dense and tied-head calls agree with MLX's own within rounding, a 21-row forward is
    split into calls of at most ``MAX_ROWS`` rows, and nothing falls back to one-row calls."""
    from workers.kernels import rowkernel

    monkeypatch.setenv("MLX_BATCHD_ROWKERNEL", "reference")
    mx.random.seed(11)
    q = nn.QuantizedLinear(128, 40, bits=4, group_size=64)
    d = nn.Linear(128, 40, bias=True)
    e = nn.Embedding(40, 128)
    for m in (q, d, e):
        m.set_dtype(dtype)
    x = mx.random.normal((21, 128), key=mx.random.key(3)).astype(dtype)
    for call in (q.__call__, d.__call__, e.as_linear):
        wide = call(x)
        with scoped(Level.ROWWISE):
            rows = call(x)
        assert rows.shape == wide.shape and rows.dtype == wide.dtype
        # fp32 products against MLX's own (which accumulates bf16 inputs in bf16: a few ulps apart)
        err = mx.max(mx.abs(rows.astype(mx.float32) - wide.astype(mx.float32))).item()
        assert err <= (5e-2 if dtype == mx.bfloat16 else 1e-4) * mx.max(mx.abs(wide.astype(mx.float32))).item()
    calls: list[int] = []

    def count(kind: str, out: mx.array, rows: int) -> mx.array:
        if kind != "attention":
            calls.append(rows if kind == "rowwise" else -rows)
        return out

    model = load_measured(llama)
    workers.kernels.seam.divergence_seam = count
    with scoped(Level.ROWWISE):
        mx.eval(model(mx.array([[(5 * i) % 250 + 3 for i in range(21)]]), cache=make_prompt_cache(model)))
    assert calls and all(c == 21 for c in calls)  # one project() per module call, never a fallback
    assert rowkernel.MAX_ROWS < 21
