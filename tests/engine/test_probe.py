"""Kernel levels, scoped pins and the exactness probe, on real models on the CPU.

MLX's CPU backend is exact almost everywhere, so most divergences here are injected through the
named seam ``workers.kernels.seam.divergence_seam``; every test that does so says it in its name.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import workers.kernels.seam
from tests.reference import load_measured, perturb
from workers import kernels
from workers.api import Job, Level, ProbePolicy
from workers.engine.engine import Engine
from workers.exact.pin_cost import BATCH_BUCKETS, REPS
from workers.exact.pins import CountedModel, PinLedger
from workers.exact.probe import drive, make_draws, probe, probe_steps, sliding_window
from workers.exact.verdict_store import VerdictStore, model_fingerprint
from workers.models.synthetic import PRESETS, write_model

VOCAB = 260


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("probe-models")
    return {
        name: write_model(root / name, PRESETS[name], seed=5)
        for name in ("tiny-llama", "qwen3-tiny", "qwen3-moe-tiny", "mistral-tiny", "gemma3-sliding-f32")
    }


pytestmark = pytest.mark.usefixtures("clean_kernel_state")


def _probe(model: Any, k: int = 3, policy: ProbePolicy | None = None, window: int | None = None, **kw: Any) -> Any:
    policy = policy or ProbePolicy()
    draws = make_draws(k, VOCAB, 4096, window)
    return probe(model, lambda: make_prompt_cache(model), {"test": True}, draws, k, policy=policy, **kw)


@pytest.mark.parametrize("name", ["tiny-llama", "qwen3-tiny", "qwen3-moe-tiny", "mistral-tiny"])
def test_pairings_pass_at_wide_on_cpu(models: dict[str, Path], name: str) -> None:
    verdict = _probe(load_measured(models[name]))
    assert (verdict.level, verdict.exact) == ("wide", True), verdict.reason
    names = [d.draw for d in verdict.ladder[0].draws]
    assert names[:3] == ["short-1", "short-2", "short-3"]
    assert any(n.startswith("capacity-256") for n in names) and any(n.startswith("long-") for n in names)


def test_sliding_window_f32_fails_wide_and_per_query_buys_it_back(models: dict[str, Path]) -> None:
    """A real CPU divergence: the rotating cache keeps decode's keys in ring order, the block sees
    them in time order. Recorded result: wide and narrow differ, per-query is exact."""
    model = load_measured(models["gemma3-sliding-f32"])
    config = json.loads((models["gemma3-sliding-f32"] / "config.json").read_text())
    verdict = _probe(model, k=4, window=sliding_window(config), policy=ProbePolicy(localize=True))
    by_level = {lr.level: lr for lr in verdict.ladder}
    assert not by_level["wide"].exact and not by_level["narrow"].exact
    failing = by_level["wide"].draws[-1]
    assert failing.differing_bytes > 0 and failing.first_position == 0
    assert failing.first_divergence is not None and "self_attn" in failing.first_divergence
    assert (verdict.level, verdict.exact) == ("per-query", True)
    assert any("past-window" in d.draw for d in by_level["per-query"].draws)


def test_injected_wide_projection_divergence_gets_a_narrow_verdict(models: dict[str, Path]) -> None:
    """Injected at the seam: projections on more than 2 rows at once differ from single rows."""
    workers.kernels.seam.divergence_seam = lambda kind, out, rows: (
        perturb(out) if kind == "projection" and rows > 2 else out
    )
    model = load_measured(models["qwen3-tiny"])  # widths measured with the divergent kernel: W = 2
    verdict = _probe(model, k=4)
    assert [lr.level for lr in verdict.ladder] == ["wide", "narrow"]
    assert not verdict.ladder[0].exact and verdict.ladder[0].draws[0].first_position == 0
    assert (verdict.level, verdict.exact) == ("narrow", True)


def test_injected_multi_query_attention_divergence_gets_a_per_query_verdict(models: dict[str, Path]) -> None:
    """Injected at the seam: attention over more than one query at once differs from decode's."""
    workers.kernels.seam.divergence_seam = lambda kind, out, rows: (
        perturb(out) if kind == "attention" and rows > 1 else out
    )
    verdict = _probe(load_measured(models["qwen3-tiny"]), k=2)
    assert [(lr.level, lr.exact) for lr in verdict.ladder] == [("wide", False), ("narrow", False), ("per-query", True)]
    assert (verdict.level, verdict.exact) == ("per-query", True)


def _block_only_divergence(kind: str, out: mx.array, rows: int) -> mx.array:
    """Injected: the output head differs whenever it runs pinned or on several rows, which no level
    can avoid (decode runs it on one row, wide)."""
    head = kind == "projection" and out.shape[-1] == VOCAB
    return perturb(out) if head and (rows > 1 or kernels.current_level() is not Level.WIDE) else out


def test_injected_divergence_no_level_fixes_is_declined(models: dict[str, Path]) -> None:
    workers.kernels.seam.divergence_seam = _block_only_divergence
    model = load_measured(models["qwen3-tiny"])
    verdict = _probe(model)
    assert verdict.level is None and not verdict.exact and verdict.reason.startswith("declined")
    assert [lr.level for lr in verdict.ladder] == ["wide", "narrow", "per-query", "per-query-1"]
    inexact = _probe(model, policy=ProbePolicy(allow_inexact=True))
    assert (inexact.level, inexact.exact) == ("wide", False)
    pinned = _probe(model, policy=ProbePolicy(pinned_level=Level.NARROW))
    assert [lr.level for lr in pinned.ladder] == ["narrow"] and (pinned.level, pinned.exact) == ("narrow", False)


def _flaky_second_chain(k: int) -> Callable[[str, mx.array, int], mx.array]:
    """Injected: classic decode that is not reproducible (its second run's head output differs)."""
    calls = {"n": 0}

    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        if kind == "projection" and out.shape[-1] == VOCAB and rows == 1:
            calls["n"] += 1
            if k + 1 < calls["n"] <= 2 * (k + 1):
                return perturb(out)
        return out

    return seam


def test_injected_nondeterministic_classic_decode_is_reported_and_declined_by_default(models: dict[str, Path]) -> None:
    model = load_measured(models["qwen3-tiny"])
    workers.kernels.seam.divergence_seam = _flaky_second_chain(3)
    verdict = _probe(model)
    first = verdict.ladder[0].draws[0]
    assert first.nondeterministic and first.chain_vs_chain_bytes > 0 and first.differing_bytes == 0
    assert verdict.level is None and "not reproducible" in verdict.reason
    workers.kernels.seam.divergence_seam = _flaky_second_chain(3)
    accepted = _probe(model, policy=ProbePolicy(accept_classic_variation=True))
    assert (accepted.level, accepted.exact) == ("wide", False)
    assert accepted.ladder[0].draws[0].accepted_as_classic_variation


def test_verdicts_are_memoised_persisted_and_reprobed_on_fingerprint_change(
    models: dict[str, Path], tmp_path: Path
) -> None:
    src = models["qwen3-tiny"]
    copy = Path(shutil.copytree(src, tmp_path / "copy"))
    model = load_measured(copy)
    store = VerdictStore(tmp_path / "verdicts")
    pairing = {"model": model_fingerprint(copy, tmp_path / "hashes"), "drafter": "none"}
    draws = make_draws(2, VOCAB, 4096, None)

    def run(p: dict[str, Any], k: int = 2) -> Any:
        return probe(model, lambda: make_prompt_cache(model), p, draws, k, store=store)

    first = run(pairing)
    assert not first.from_cache and (tmp_path / "verdicts" / f"{first.fingerprint}.json").exists()
    again = run(pairing)
    assert again.from_cache and again.fingerprint == first.fingerprint and again.level == first.level
    assert again.ladder[0].draws[0].total_bytes == first.ladder[0].draws[0].total_bytes
    assert not run(pairing, k=3).from_cache  # another K is another pairing
    assert not run({**pairing, "drafter": "prompt-lookup"}).from_cache
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")  # the weights changed on disk
    changed = {**pairing, "model": model_fingerprint(copy, tmp_path / "hashes")}
    assert changed["model"] != pairing["model"]
    assert not run(changed).from_cache
    store.path(first.fingerprint).write_text("{ damaged")
    assert not run(pairing).from_cache  # a damaged verdict is re-measured, never trusted


def _forwards(ledger: PinLedger) -> int:
    snap = ledger.snapshot()
    return sum(r["forwards"] for r in [*snap["pinned"], *snap["unrequested"]])


def test_the_pin_cost_is_measured_once_with_the_verdict_and_stored_with_it(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """After the ladder the probe times a batched decode step at each rung that pins against wide, at
    every batch bucket, and stores the rows with the verdict; the verdict read back from the store
    brings them without a forward run (serving never measures them)."""
    model = load_measured(models["tiny-llama"])
    ledger = PinLedger()
    counted = CountedModel(model, ledger)
    store = VerdictStore(tmp_path / "verdicts")
    draws = make_draws(2, VOCAB, 4096, None)

    def run() -> Any:
        return probe(counted, lambda: make_prompt_cache(model), {"t": "pin cost"}, draws, 2, store=store)

    first = run()
    assert (first.level, first.rungs) == ("wide", ["wide", "narrow", "per-query", "per-query-1"])
    rungs = ["narrow", "per-query", "per-query-1"]
    assert [(r.level, r.batch) for r in first.pin_cost] == [(lv, b) for b in BATCH_BUCKETS for lv in rungs]
    assert all(r.wide_step_s > 0 and r.ratio == r.pinned_step_s / r.wide_step_s for r in first.pin_cost)
    pinned_rows = {r["level"]: r["rows"] for r in ledger.snapshot()["pinned"]}
    # Only the pin cost ran the rungs (the ladder stopped at wide): each bucket's step, REPS + 1 times.
    assert {lv: pinned_rows[lv] for lv in rungs} == dict.fromkeys(rungs, (REPS + 1) * sum(BATCH_BUCKETS))
    forwards = _forwards(ledger)
    again = run()
    assert again.from_cache and again.pin_cost == first.pin_cost
    assert _forwards(ledger) == forwards  # read back, not measured again


def test_a_serving_engines_probe_measures_the_pin_cost_only_up_to_its_max_batch(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """An engine that decodes at most 8 sequences together never runs the 32- and 128-row steps a
    process-wide pin would slow, so its probe does not time them (on a small CPU they would hold
    the verdict back for minutes)."""
    model = load_measured(models["tiny-llama"])
    ledger = PinLedger()
    draws = make_draws(2, VOCAB, 4096, None)
    steps = probe_steps(
        CountedModel(model, ledger), lambda: make_prompt_cache(model), {"t": "cap"}, draws, 2, max_batch=8
    )
    verdict = drive(steps)
    rungs = ["narrow", "per-query", "per-query-1"]
    assert [(r.level, r.batch) for r in verdict.pin_cost] == [(lv, b) for b in (1, 8) for lv in rungs]
    pinned_rows = {r["level"]: r["rows"] for r in ledger.snapshot()["pinned"]}
    assert {lv: pinned_rows[lv] for lv in rungs} == dict.fromkeys(rungs, (REPS + 1) * (1 + 8))


def _engine(path: Path, **kw: Any) -> Engine:
    model = load_measured(path)
    return Engine(model, eos_token_ids=(0,), vocab_size=VOCAB, **kw)


def _row_counts() -> tuple[list[int], Callable[[str, mx.array, int], mx.array]]:
    seen: list[int] = []

    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        if kind == "projection":
            seen.append(rows)
        return out

    return seen, seam


def test_scoped_pin_reaches_only_its_forward_while_batched_decode_interleaves(models: dict[str, Path]) -> None:
    workers.kernels.seam.divergence_seam = lambda kind, out, rows: out
    engine = _engine(models["tiny-llama"])
    kernels._widths.update({k: 2 for k in kernels._widths})  # narrow chunks of 2, to see it work
    for seq in range(3):
        engine.submit(Job(seq=seq, prompt=[5 + seq, 6, 7], max_tokens=50))
    while engine.batch_size() < 3:
        engine.step()
    cache = make_prompt_cache(engine.model)
    engine.forward(mx.array([[1, 2, 3]]), cache)  # wide prefill for the "verify" sequence

    seen, workers.kernels.seam.divergence_seam = _row_counts()
    with engine.pinned(Level.NARROW, "verify"):
        logits = engine.forward(mx.array([[4, 5, 6, 7, 8]]), cache)
        verify_rows = list(seen)
        seen.clear()
        events = engine.step()  # a batched decode step inside the pinned block
        batched_rows = list(seen)
        mx.eval(logits)
    assert max(verify_rows) <= 2  # the verify ran narrow (chunks of at most W = 2)
    assert max(batched_rows) == 3  # the batched step ran wide: all 3 rows in one call
    assert len([e for e in events if hasattr(e, "tokens")]) == 3

    pins = engine.ledger.snapshot()
    assert pins["pinned"] == [
        {"level": "narrow", "purpose": "verify", "forwards": 1, "rows": 5, "seconds": pins["pinned"][0]["seconds"]}
    ]
    assert pins["pinned"][0]["seconds"] > 0
    assert {r["level"] for r in pins["unrequested"]} == {"wide"}
    assert pins["collateral_forwards"] == 0


def test_process_wide_pin_makes_batched_decode_collateral(models: dict[str, Path]) -> None:
    """The bench's arm: a process-wide pin (``set_process_level``) runs every forward at its level."""
    engine = _engine(models["tiny-llama"])
    kernels._widths.update({k: 2 for k in kernels._widths})
    seen, workers.kernels.seam.divergence_seam = _row_counts()
    kernels.set_process_level(Level.NARROW)
    for seq in range(3):
        engine.submit(Job(seq=seq, prompt=[5 + seq, 6, 7], max_tokens=4))
    while engine.has_work:
        engine.step()
    assert max(seen) <= 2  # every forward, prefill and decode, chunked
    pins = engine.ledger.snapshot()
    assert pins["collateral_forwards"] > 0 and pins["collateral_seconds"] > 0
    assert {r["level"] for r in pins["unrequested"]} == {"narrow"}
