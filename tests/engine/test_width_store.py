"""Measured widths kept on disk: a second load of the same model on the same machine registers the
stored widths without a forward; a forged file, another backend, a changed weight file or the test
seam measure them again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import pytest

import workers.kernels.seam
from workers.kernels import calibration, qmv_rows, widths
from workers.models import load, width_store
from workers.models.synthetic import llama_config, write_model


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """A private cache folder, and the measurement's comparisons counted (one per width tried)."""
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    compared: list[int] = []
    real = calibration.bytes_equal

    def counting(a: mx.array, b: mx.array) -> bool:
        compared.append(1)
        return real(a, b)

    monkeypatch.setattr(calibration, "bytes_equal", counting)
    return compared


def _files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "widths").glob("*.json"))


def _registered(model: object) -> dict[int, int]:
    return {id(m): widths.chunk_widths[id(m)] for _, m in model.named_modules() if id(m) in widths.chunk_widths}  # type: ignore[attr-defined]


def test_a_second_load_registers_the_stored_widths_without_a_forward(
    tiny_model: Path, tmp_path: Path, counted: list[int]
) -> None:
    first = load(str(tiny_model))
    assert not first.widths.stored and counted and len(_files(tmp_path)) == 1
    counted.clear()
    second = load(str(tiny_model))
    assert second.widths.stored and not counted
    assert second.widths.widths == first.widths.widths
    assert sorted(_registered(second.model).values()) == sorted(_registered(first.model).values())
    assert len(_registered(second.model)) > 0


@pytest.mark.parametrize("forged", [{"x": 1}, "widths", "zero", "too wide", "not json"])
def test_a_forged_widths_file_is_measured_again_and_rewritten(
    tiny_model: Path, tmp_path: Path, counted: list[int], forged: object
) -> None:
    first = load(str(tiny_model))
    (path,) = _files(tmp_path)
    sig = next(iter(first.widths.widths))
    if forged == "zero":
        text = json.dumps({**first.widths.widths, sig: 0})
    elif forged == "too wide":
        text = json.dumps({**first.widths.widths, sig: widths.MAX_MEASURED_WIDTH + 1})
    elif forged == "not json":
        text = "{"
    else:
        text = json.dumps(forged)
    path.write_text(text)
    counted.clear()
    again = load(str(tiny_model))
    assert not again.widths.stored and counted
    assert again.widths.widths == first.widths.widths
    assert json.loads(path.read_text()) == first.widths.widths


def test_another_backend_or_a_changed_weight_file_is_measured_again(
    tiny_model: Path, tmp_path: Path, counted: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    load(str(tiny_model))
    real = width_store.backend_fingerprint
    monkeypatch.setattr(width_store, "backend_fingerprint", lambda: {**real(), "mlx": "0.0.0"})
    counted.clear()
    assert not load(str(tiny_model)).widths.stored and counted
    monkeypatch.setattr(width_store, "backend_fingerprint", real)
    assert load(str(tiny_model)).widths.stored
    weights = next(tiny_model.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        counted.clear()
        assert not load(str(tiny_model)).widths.stored and counted
    finally:  # the session's model, as other tests found it
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(_files(tmp_path)) == 3


def test_under_the_test_seam_widths_are_neither_read_nor_kept(
    tiny_model: Path, tmp_path: Path, counted: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    load(str(tiny_model))
    monkeypatch.setattr(workers.kernels.seam, "divergence_seam", lambda kind, out, rows: out)
    counted.clear()
    assert not load(str(tiny_model)).widths.stored and counted
    assert len(_files(tmp_path)) == 1


def test_a_load_for_an_engine_that_never_pins_measures_and_stores_no_widths(tmp_path: Path, counted: list[int]) -> None:
    """``load(widths=False)`` (an engine without a drafter or a probe): no forward, no width file, no
    module with a width (above ``wide`` each would run one row a call); the projections' patches and
    sibling groups, which batched decode uses, are installed as with the widths."""
    model = write_model(tmp_path / "q4", llama_config(hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, quant_bits=4))
    loaded = load(str(model), widths=False)
    assert loaded.widths.skipped and not loaded.widths.widths and not loaded.widths.stored
    assert not counted and _files(tmp_path) == [] and _registered(loaded.model) == {}
    attention = loaded.model.layers[0].self_attn  # type: ignore[attr-defined]
    group = qmv_rows.siblings(attention.q_proj)
    assert group is not None and [id(m) for m in group] == [
        id(attention.q_proj),
        id(attention.k_proj),
        id(attention.v_proj),
    ]
    assert hasattr(type(attention.q_proj).__call__, "__wrapped__")  # the projections' patch
    measured = load(str(model))
    assert not measured.widths.skipped and counted and len(_files(tmp_path)) == 1
