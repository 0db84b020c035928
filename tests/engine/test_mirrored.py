"""The ``mirrored`` rung: a verify block whose quantized projections repeat decode's own one-row
kernel arithmetic (``qmv_rows``), so classic decode stays as it is (no chain pin).

MLX's CPU kernels are row-exact, so the divergence this rung exists for (MLX CUDA's several-row
kernel differs from its one-row kernel) is injected at the named seam ``workers.kernels.seam.divergence_seam``;
tests that do so say it in their names. The CUDA kernel cannot run on this CPU: with the switch at
``reference`` every row takes the rung's fallback (decode's own one-row call), and the kernel's
fail-closed check is exercised with a stand-in for the CUDA launch (named as such).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

import workers.kernels.seam
from tests.engine.test_chain_levels import VOCAB, _classic_forwards, _generate, _pinned_engine
from tests.engine.test_chain_levels import cuda_ladder as cuda_ladder
from tests.engine.test_chain_levels import llama as llama
from tests.helpers.mirrored import _quantized, one_row_launch
from tests.reference import load_measured
from workers.api import Level, ProbePolicy
from workers.engine.engine import Engine
from workers.exact.probe import make_draws, probe
from workers.kernels import bytes_equal, qmv_rows, scoped
from workers.models.synthetic import llama_config, write_model

pytestmark = pytest.mark.usefixtures("clean_kernel_state")


@pytest.fixture
def mirrored_ladder(cuda_ladder: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA ladder on this CPU with the project's kernels at their reference implementations."""
    monkeypatch.setenv("MLX_BATCHD_ROWKERNEL", "reference")


@pytest.fixture
def fresh_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qmv_rows, "_matches_mlx", {})
    monkeypatch.setattr(qmv_rows, "_ready", {})
    monkeypatch.setattr(qmv_rows, "_compiled", None)
    monkeypatch.setattr(qmv_rows, "_checked", None)


def _several_rows_differ(kind: str, out: mx.array, rows: int) -> mx.array:
    """Injected: a projection computed on several rows at once comes out different from the same rows
    computed one at a time (MLX CUDA's batched kernel against its matrix-vector kernel)."""
    return out * 1.5 if kind == "projection" and rows > 1 else out


@pytest.mark.usefixtures("mirrored_ladder")
def test_injected_several_row_divergence_is_exact_at_mirrored_first_after_wide(llama: Path) -> None:
    """Injected: several-row projection calls differ. Wide differs; mirrored, the next rung, is exact
    at every draw, because each of its rows is the one-row call classic decode makes."""
    model = load_measured(llama)
    workers.kernels.seam.divergence_seam = _several_rows_differ
    draws = make_draws(3, VOCAB, 4096, None)
    verdict = probe(model, lambda: make_prompt_cache(model), {"test": "mirrored"}, draws, 3, policy=ProbePolicy())
    assert [(lr.level, lr.exact) for lr in verdict.ladder] == [("wide", False), ("mirrored", True)]
    assert (verdict.level, verdict.exact) == ("mirrored", True), verdict.reason


@pytest.mark.usefixtures("mirrored_ladder")
def test_injected_several_row_divergence_bursts_at_mirrored_emit_unpinned_classic_decode(llama: Path) -> None:
    """Injected: several-row projection calls differ. Bursts at mirrored emit exactly what an engine
    without bursts emits, every round audited clean, and the lone sequence's classic steps are
    never pinned (the rung leaves classic decode as it is)."""
    model = load_measured(llama)
    workers.kernels.seam.divergence_seam = _several_rows_differ
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    reference = _generate(Engine(model, eos_token_ids=(0,), vocab_size=VOCAB), prompt, 30)
    engine = _pinned_engine(model, Level.MIRRORED)
    assert _generate(engine, prompt, 30) == reference
    summary = engine.burst_summary()
    assert summary["rounds"] > 0 and summary["audits"] == summary["rounds"] and summary["audit_failures"] == 0
    assert _classic_forwards(engine, Level.MIRRORED) == 0


@pytest.mark.usefixtures("fresh_checks")
def test_a_stand_in_kernel_equal_to_mlx_is_used_and_one_that_differs_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stand-in for the CUDA launch (the kernel cannot run here): one that returns MLX's own one-row
    results is taken for that layer shape after one check; one a single rounding step off is refused
    for good (``project`` answers ``None``: the caller makes decode's one-row calls)."""
    monkeypatch.setattr(qmv_rows.rowkernel, "implementation", lambda: "cuda")
    launches: list[int] = []

    equal = one_row_launch(lambda x, mats: launches.append(x.shape[0]))

    q = _quantized()
    original = type(q).__call__
    original = getattr(original, "__wrapped__", original)
    x = mx.random.normal((11, 256), key=mx.random.key(2)).astype(mx.bfloat16)
    monkeypatch.setattr(qmv_rows, "_launch", equal)
    out = qmv_rows.project(q, original, x)
    assert out is not None and bytes_equal(out, mx.concatenate([original(q, x[i : i + 1]) for i in range(11)]))
    checks = len(launches)
    assert qmv_rows.project(q, original, x) is not None
    assert len(launches) == checks + 2  # 11 rows: calls of 8 and 3; the check is not repeated
    assert list(qmv_rows.report().values()) == [True]

    def off_by_one_step(x: mx.array, mats: list[tuple[mx.array, ...]], bits: int, gs: int) -> list[mx.array]:
        return [(o.view(mx.uint16) ^ mx.array(1, dtype=mx.uint16)).view(mx.bfloat16) for o in equal(x, mats, bits, gs)]

    other = nn.QuantizedLinear(256, 40, bits=4, group_size=64)
    other.set_dtype(mx.bfloat16)
    monkeypatch.setattr(qmv_rows, "_launch", off_by_one_step)
    assert qmv_rows.project(other, original, x) is None
    assert sorted(qmv_rows.report().values()) == [False, True]


@pytest.mark.usefixtures("fresh_checks")
def test_a_layers_siblings_share_one_stand_in_launch_and_keep_decodes_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stand-in for the CUDA launch (the kernel cannot run here) on a 4-bit model: at mirrored the
    first of q/k/v (and of gate/up) computes the group in one launch, the others take their outputs
    from it, and the block's logits are wide's (on this row-exact CPU) byte for byte."""
    model = load_measured(write_model(tmp_path / "q4", llama_config(quant_bits=4), seed=3))
    layers = len(model.model.layers)
    assert qmv_rows.register_siblings(model) == 2 * layers
    monkeypatch.setattr(qmv_rows.rowkernel, "implementation", lambda: "cuda")
    launches: list[int] = []

    equal = one_row_launch(lambda x, mats: launches.append(len(mats)))

    monkeypatch.setattr(qmv_rows, "_launch", equal)
    tokens = mx.array([[(7 * i) % 250 + 3 for i in range(6)]])
    wide = model(tokens, cache=make_prompt_cache(model))
    for _ in range(2):  # the first block also runs each shape's check
        launches.clear()
        with scoped(Level.MIRRORED):
            block = model(tokens, cache=make_prompt_cache(model))
        mx.eval(wide, block)
        assert bytes_equal(block, wide)
    # Per layer: q/k/v in one launch, o alone, gate/up in one, down alone; then the tied head.
    assert launches == [3, 1, 2, 1] * layers + [1]
    assert not qmv_rows._kept  # every sibling's output was taken by its own call


@pytest.mark.usefixtures("mirrored_ladder")
def test_mirrored_projections_on_this_cpu_are_decodes_one_row_calls(llama: Path) -> None:
    """With the reference switch every several-row projection at mirrored is made as one-row calls
    (what the rung falls back to), and the block's logits equal wide's on this row-exact CPU."""
    model = load_measured(llama)
    tokens = mx.array([[(7 * i) % 250 + 3 for i in range(6)]])
    wide = model(tokens, cache=make_prompt_cache(model))
    rows_seen: set[int] = set()

    def count(kind: str, out: mx.array, rows: int) -> mx.array:
        if kind != "attention":
            rows_seen.add(rows)
        return out

    workers.kernels.seam.divergence_seam = count
    with scoped(Level.MIRRORED):
        block = model(tokens, cache=make_prompt_cache(model))
    mx.eval(wide, block)
    assert rows_seen == {1} and bytes_equal(block, wide)
