"""Widths outside one probe: a stored verdict whose widths or rungs were forged or damaged is probed
again, and the widths measured for a model leave with it (module ids are reused once it is collected).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.engine.test_ladder import VOCAB
from tests.engine.test_ladder import llama as llama
from tests.reference import load_measured
from workers import kernels
from workers.api import Level, ProbePolicy
from workers.exact.pin_cost import BATCH_BUCKETS
from workers.exact.probe import make_draws, probe
from workers.exact.verdict_store import VerdictStore

pytestmark = pytest.mark.usefixtures("clean_kernel_state")


@pytest.fixture(scope="module")
def stored_narrow(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """A verdict at a calibrated rung (narrow, pinned by the operator) as the store writes it:
    (fingerprint, its JSON), widths included."""
    model = load_measured(llama)
    store = VerdictStore(tmp_path_factory.mktemp("verdicts"))
    draws = make_draws(2, VOCAB, 4096, None)[:1]
    policy = ProbePolicy(pinned_level=Level.NARROW)
    verdict = probe(model, lambda: make_prompt_cache(model), {"t": "forged"}, draws, 2, store=store, policy=policy)
    assert (verdict.level, verdict.exact, verdict.rungs) == ("narrow", True, ["narrow"]) and verdict.widths
    assert [(r.level, r.batch) for r in verdict.pin_cost] == [("narrow", b) for b in BATCH_BUCKETS]
    return verdict.fingerprint, json.loads(store.path(verdict.fingerprint).read_text())


def _forge(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set the field at ``path`` (dots; digits index lists) to ``value``."""

    def forge(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[int(last) if last.isdigit() else last] = value

    return forge


def _width(value: Any) -> Callable[[dict[str, Any]], None]:
    """Set one module's stored width (module paths hold dots, so not through ``_forge``)."""

    def forge(data: dict[str, Any]) -> None:
        data["widths"]["model.layers.0.mlp.gate_proj"] = value

    return forge


FORGERIES: dict[str, Callable[[dict[str, Any]], None]] = {
    "width-zero": _width(0),
    "width-past-the-measured-range": _width(99),
    "width-a-bool": _width(True),
    "width-a-string": _width("2"),
    "widths-a-list": _forge("widths", ["a"]),
    "widths-dropped-at-a-calibrated-rung": _forge("widths", {}),
    "rung-unknown": _forge("rungs", ["warp"]),
    "rung-unknown-after-those-reached": _forge("rungs", ["narrow", "warp"]),
    "rungs-not-the-ladder-reached": _forge("rungs", ["wide", "narrow"]),
    "narrowed-widened": _forge("ladder.0.narrowed", {"model.layers.0.mlp.gate_proj": [2, 16]}),
    "narrowed-not-a-pair": _forge("ladder.0.narrowed", {"model.layers.0.mlp.gate_proj": [16]}),
    "skipped-not-a-string": _forge("ladder.0.skipped", 5),
    "skipped-rung-with-draws": _forge("ladder.0.skipped", "this is per-query-1"),
    "draw-narrowed-negative": _forge("ladder.0.draws.0.narrowed", -1),
    "level-a-rung-that-did-not-run": _forge("level", "per-query-1"),
    "exact-without-an-exact-rung": _forge("ladder.0.exact", False),
    "pin-cost-not-a-list": _forge("pin_cost", {"narrow": 1.0}),
    "pin-cost-row-not-an-object": _forge("pin_cost.0", [1, 2]),
    "pin-cost-row-missing-a-field": _forge("pin_cost.0", {"level": "narrow", "batch": 1, "ratio": 1.0}),
    "pin-cost-batch-zero": _forge("pin_cost.0.batch", 0),
    "pin-cost-ratio-negative": _forge("pin_cost.0.ratio", -1.0),
    "pin-cost-ratio-not-finite": _forge("pin_cost.0.ratio", float("inf")),
    "pin-cost-at-a-rung-off-the-ladder": _forge("pin_cost.0.level", "per-query"),
    "pin-cost-at-wide": _forge("pin_cost.0.level", "wide"),
}


@pytest.mark.parametrize("forgery", [None, *FORGERIES])
def test_a_stored_verdict_with_forged_widths_or_rungs_is_reprobed(
    stored_narrow: tuple[str, dict[str, Any]], tmp_path: Path, forgery: str | None
) -> None:
    """Widths and rungs decide how the verify is computed, so a stored verdict's are checked like
    the rest, each field and the fields against each other; the genuine file (``None``) reads back."""
    fingerprint, genuine = stored_narrow
    data = copy.deepcopy(genuine)
    if forgery is not None:
        FORGERIES[forgery](data)
    store = VerdictStore(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    store.path(fingerprint).write_text(json.dumps(data))
    assert (store.get(fingerprint) is None) == (forgery is not None)


def test_a_collected_models_widths_are_forgotten(llama: Path) -> None:
    """Widths are kept by module id, and Python reuses a dead object's id: a model that is gone must
    leave no width behind for a later module to inherit."""
    import gc

    model = load_measured(llama)
    ids = [id(m) for _, m in model.named_modules() if id(m) in kernels._measured]
    assert ids
    del model
    gc.collect()
    assert not any(mid in kernels._measured or mid in kernels._widths for mid in ids)


def test_saved_widths_does_not_bring_back_a_collected_models_widths(llama: Path) -> None:
    """What the tests' kernel-state fixture restores: only modules still alive. A restored entry of a
    collected module would hand its width to the next module Python gives that id (the full suite
    once failed this way, depending on when the garbage collector ran)."""
    import gc

    model = load_measured(llama)
    ids = [id(m) for _, m in model.named_modules() if id(m) in kernels._measured]
    with kernels.saved_widths():
        del model
        gc.collect()
    assert ids and not any(mid in kernels._measured or mid in kernels._widths for mid in ids)
