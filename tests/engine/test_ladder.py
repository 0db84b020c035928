"""The ladder does not lie about widths: calibration on the probe's own activations, the rung that
is exact by construction (``per-query-1``), and single-sequence caches with a stable layout.

MLX's CPU kernels are row-exact, so the failure calibration exists for (a width measured on random
rows at load that does not hold on a real block's rows) is injected at the named seam
``workers.kernels.seam.divergence_seam``; every test that does so says it in its name. The injected
divergences depend on the data, as a kernel's byte differences can: they fire only on
"real-activation-like" rows (RMS-normed, RMS ~1), never on the load-time measurement's random
rows (RMS 0.5), so load-time widths pass and only the probe's own calibration can catch them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

import workers.kernels.seam
from tests.reference import load_measured, perturb, probed_bursts
from workers import kernels
from workers.api import BurstSettings, Job, Level, ProbePolicy, Tokens
from workers.engine.engine import Engine
from workers.engine.spec.drafters import DraftModel
from workers.exact.draws import run_block, within_draw
from workers.exact.pin_cost import BATCH_BUCKETS
from workers.exact.pins import CountedModel, PinLedger
from workers.exact.probe import Verdict, make_draws, probe
from workers.exact.report import iter_table, ladder_line, narrowed_widths
from workers.exact.verdict_store import VerdictStore
from workers.kernels import LAYOUT_STEP, measure_widths
from workers.kernels.mlxlm import merge_caches
from workers.models.synthetic import PRESETS, write_model

VOCAB = 260
#: RMS above which a projection's input rows look like a real block's (RMS-normed activations are
#: ~1.0 in these models; the load-time measurement feeds random rows of RMS ~0.5).
REAL_RMS = 0.75


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers x 256, bf16, tied head: the demo pair's shape class (6 x 256 bf16)."""
    return write_model(tmp_path_factory.mktemp("ladder") / "tiny-llama", PRESETS["tiny-llama"], seed=5)


pytestmark = pytest.mark.usefixtures("clean_kernel_state")


def _probe(model: Any, k: int = 3, policy: ProbePolicy | None = None, **kw: Any) -> Verdict:
    draws = make_draws(k, VOCAB, 4096, None)
    return probe(
        model, lambda: make_prompt_cache(model), {"test": "ladder"}, draws, k, policy=policy or ProbePolicy(), **kw
    )


def _real_like() -> bool:
    """Whether the call the seam is looking at got rows like a real block's (see ``REAL_RMS``)."""
    call = workers.kernels.seam.seam_call
    assert call is not None
    x = call.inputs.astype(mx.float32)
    return float(mx.sqrt(mx.mean(x * x)).item()) > REAL_RMS


def _paths(model: Any) -> dict[int, str]:
    return {id(m): p for p, m in model.named_modules()}


def _load_time_widths(model: Any) -> dict[str, int]:
    names = _paths(model)
    return {names[mid]: w for mid, w in kernels._measured.items() if mid in names}


# --------------------------------------------------------------------------- calibration


def test_injected_divergence_on_real_rows_only_is_caught_by_calibration_and_memoised(
    llama: Path, tmp_path: Path
) -> None:
    """Injected: a projection on more than 2 real-like rows differs from one-row calls. The
    load-time measurement (random rows) says every width is 16; the probe's calibration narrows
    the modules that see such rows to 2 and narrow is exact. The widths are in the verdict, serve
    after it, and come back with it from the store."""
    model = load_measured(llama)

    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        return perturb(out) if kind == "projection" and rows > 2 and _real_like() else out

    workers.kernels.seam.divergence_seam = seam
    measure_widths(model)  # measured with the divergent kernel in place: random rows pass
    assert set(_load_time_widths(model).values()) == {16}
    store = VerdictStore(tmp_path / "verdicts")
    verdict = _probe(model, store=store)

    assert [(lr.level, lr.exact) for lr in verdict.ladder] == [("wide", False), ("narrow", True)]
    assert (verdict.level, verdict.exact) == ("narrow", True), verdict.reason
    assert "narrowed by calibration" in verdict.reason
    narrowed = narrowed_widths(verdict)
    normed = {f"model.layers.{i}.{m}" for i in range(4) for m in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert normed <= set(narrowed) and "model.embed_tokens" in narrowed  # the tied head reads the final norm
    assert all(before == 16 and after == 2 for before, after in narrowed.values())
    assert "model.layers.0.mlp.down_proj" not in narrowed and verdict.widths["model.layers.0.mlp.down_proj"] == 16
    assert verdict.ladder[1].draws[0].narrowed == len(narrowed)  # found on the first draw, then held
    assert all(d.narrowed == 0 for d in verdict.ladder[1].draws[1:])

    served = {p: kernels._widths[mid] for mid, p in _paths(model).items() if mid in kernels._widths}
    assert served == verdict.widths and served["model.layers.2.mlp.gate_proj"] == 2
    kernels.reset_widths(model)  # a restart: load-time widths again, until the verdict is read
    assert kernels.widths_by_path(model)["model.layers.2.mlp.gate_proj"] == 16
    again = _probe(model, store=store)
    assert again.from_cache and again.widths == verdict.widths
    assert kernels.widths_by_path(model) == verdict.widths


def test_injected_divergence_in_layer_2_mlp_narrows_that_layer_only(llama: Path) -> None:
    """Injected: the shape of the demo pair's failure that issue 14 reports on MLX CUDA (first
    divergence at layer 2's MLP, position 0): layer 2's MLP projections on several real-like rows
    differ from one-row calls. Calibration narrows exactly those modules, not the modules of
    the same shape in other layers."""
    model = load_measured(llama)
    layer2 = model.model.layers[2].mlp
    targets = {id(layer2.gate_proj), id(layer2.up_proj), id(layer2.down_proj)}

    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        call = workers.kernels.seam.seam_call
        hit = kind == "projection" and rows > 1 and call is not None and id(call.module) in targets
        return perturb(out) if hit and _real_like() else out

    workers.kernels.seam.divergence_seam = seam
    verdict = _probe(model, policy=ProbePolicy(localize=True))

    wide = verdict.ladder[0]
    assert not wide.exact and wide.draws[0].first_divergence == "layer 2 mlp, position 0"
    assert (verdict.level, verdict.exact) == ("narrow", True), verdict.reason
    assert narrowed_widths(verdict) == {"model.layers.2.mlp.gate_proj": [16, 1], "model.layers.2.mlp.up_proj": [16, 1]}
    for layer in (0, 1, 3):
        assert verdict.widths[f"model.layers.{layer}.mlp.gate_proj"] == 16


def test_injected_divergence_found_on_a_later_draw_reruns_the_rungs_earlier_draws(llama: Path) -> None:
    """Injected from the second draw on (armed by the probe's own progress label): a projection on
    3 or 4 real-like rows (a block's, never a prefill's, so the chains computed before arming
    stay valid) differs. The first draw passed narrow at width 16; the second narrows widths to 2,
    so the rung starts over and every draw is checked at the widths the verdict carries."""
    model = load_measured(llama)
    armed = False

    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        return perturb(out) if armed and kind == "projection" and 2 < rows <= 4 and _real_like() else out

    labels: list[str] = []

    def progress(label: str) -> None:
        nonlocal armed
        if not within_draw(label):
            labels.append(label)
        armed = armed or label == "narrow: short-2"

    workers.kernels.seam.divergence_seam = seam
    draws = make_draws(3, VOCAB, 4096, None)
    policy = ProbePolicy(pinned_level=Level.NARROW)
    verdict = probe(model, lambda: make_prompt_cache(model), {"t": "rerun"}, draws, 3, policy=policy, progress=progress)
    names = [d.name for d in draws]
    assert labels == [
        "narrow: short-1",
        "narrow: short-2",
        *(f"narrow: {n} (again, with narrowed widths)" for n in names[:2]),
        *(f"narrow: {n}" for n in names[2:]),
        *(f"pin cost at narrow, batch {b}" for b in BATCH_BUCKETS),  # after the ladder, one step each
    ]
    assert (verdict.level, verdict.exact) == ("narrow", True), verdict.reason
    assert [d.draw for d in verdict.ladder[0].draws] == names
    assert narrowed_widths(verdict) and set(verdict.widths.values()) == {2, 16}


def test_calibration_captures_the_blocks_projection_calls_not_the_prefills(llama: Path) -> None:
    """Only the block's own rows are checked: under a process-wide pin the prefill runs at narrow
    too, and its many rows are not the verify's."""
    model = load_measured(llama)
    kernels.set_process_level(Level.NARROW)
    draw = make_draws(3, VOCAB, 4096, None)[0]
    calls: list[kernels.CapturedCall] = []
    run_block(model, lambda: make_prompt_cache(model), draw, [1, 2, 3, 4], Level.NARROW, calls)
    assert calls and {c.rows.shape[0] for c in calls} == {4}


# --------------------------------------------------------------------------- the by-construction rung


def _every_multi_row_call(kind: str, out: mx.array, rows: int) -> mx.array:
    """Injected: every projection on more than one row and every attention over more than one
    query differs from decode's one-row, one-query calls."""
    return perturb(out) if rows > 1 else out


def test_injected_divergence_in_every_multi_row_call_wins_the_per_query_1_rung(llama: Path) -> None:
    """Injected after load (so load-time widths are 16): every multi-row call differs. Calibration
    narrows every projection to one row, so per-query would be per-query-1 and is skipped as that;
    per-query-1, one row per projection call and one query per attention call, is exact."""
    model = load_measured(llama)
    workers.kernels.seam.divergence_seam = _every_multi_row_call
    verdict = _probe(model)

    assert verdict.rungs == ["wide", "narrow", "per-query", "per-query-1"]
    assert [(lr.level, lr.exact) for lr in verdict.ladder] == [
        ("wide", False),
        ("narrow", False),
        ("per-query", False),
        ("per-query-1", True),
    ]
    assert verdict.ladder[2].skipped is not None and verdict.ladder[2].draws == []
    assert (verdict.level, verdict.exact) == ("per-query-1", True), verdict.reason
    assert set(verdict.widths.values()) == {1}
    assert ladder_line(verdict) == (
        "wide: differs -> narrow: differs -> per-query: skipped -> per-query-1: exact (won)"
    )
    rows = list(iter_table(verdict))
    assert [r[0] for r in rows if r[0].endswith("(won)")] == ["per-query-1 (won)"] * len(verdict.ladder[3].draws)
    assert any(r[0] == "per-query" and r[1].startswith("skipped") for r in rows)
    assert any("capacity-256" in d.draw for d in verdict.ladder[3].draws)


def test_injected_divergence_calibration_cannot_see_falls_through_to_per_query_1(llama: Path) -> None:
    """Injected: every multi-row call differs, but only inside a pinned forward (a kernel whose
    result depends on what surrounds it in the forward), so the calibration's own comparisons see
    row-exact kernels and keep every width at 16. narrow and per-query then
    differ, and the rung that takes no width on trust is exact."""
    model = load_measured(llama)

    def seam(kind: str, out: mx.array, rows: int) -> mx.array:
        return perturb(out) if rows > 1 and kernels.in_scoped_pin() else out

    workers.kernels.seam.divergence_seam = seam
    verdict = _probe(model)
    assert [(lr.level, lr.exact, lr.skipped) for lr in verdict.ladder] == [
        ("wide", False, None),
        ("narrow", False, None),
        ("per-query", False, None),
        ("per-query-1", True, None),
    ]
    assert narrowed_widths(verdict) == {} and set(verdict.widths.values()) == {16}
    assert (verdict.level, verdict.exact) == ("per-query-1", True), verdict.reason


def test_per_query_1_pin_reaches_only_its_forward_while_batched_decode_interleaves(llama: Path) -> None:
    """A verify at per-query-1: every projection of the block on one row, attention one query at
    a time; a batched step built inside the pin runs wide (all rows in one call) and the ledger's
    collateral stays 0."""
    model = load_measured(llama)
    engine = Engine(model, eos_token_ids=(0,), vocab_size=VOCAB)
    for seq in range(3):
        engine.submit(Job(seq=seq, prompt=[5 + seq, 6, 7], max_tokens=50))
    while engine.batch_size() < 3:
        engine.step()
    cache = make_prompt_cache(engine.model)
    engine.forward(mx.array([[1, 2, 3]]), cache)  # wide prefill for the "verify" sequence

    seen: dict[str, list[int]] = {"projection": [], "attention": []}

    def count(kind: str, out: mx.array, rows: int) -> mx.array:
        seen[kind].append(rows)
        return out

    workers.kernels.seam.divergence_seam = count
    with engine.pinned(Level.PER_QUERY_1, "verify"):
        logits = engine.forward(mx.array([[4, 5, 6, 7, 8]]), cache)
        verify = {k: list(v) for k, v in seen.items()}
        for v in seen.values():
            v.clear()
        engine.step()  # a batched decode step inside the pinned block
        mx.eval(logits)
    assert set(verify["projection"]) == {1} and set(verify["attention"]) == {1}
    assert len(verify["attention"]) == 5 * len(model.model.layers)  # one call per query per layer
    assert max(seen["projection"]) == 3  # the batched step: all 3 rows in one call
    pins = engine.ledger.snapshot()
    assert [(r["level"], r["purpose"], r["forwards"]) for r in pins["pinned"]] == [("per-query-1", "verify", 1)]
    assert {r["level"] for r in pins["unrequested"]} == {"wide"} and pins["collateral_forwards"] == 0


def _engine_with_bursts(model: Any, verdict_level: str | None) -> Engine:
    """An engine whose drafter is the target itself (every draft accepted), gated by a real probe
    of the pairing run to its end; every round audited."""
    engine = Engine(model, eos_token_ids=(0,), vocab_size=VOCAB, max_batch=8)
    settings = BurstSettings(k=3, audit_fraction=1.0, profile_steps=0, min_rounds=10**9)
    verdict = probed_bursts(engine, model, DraftModel(model, name="self"), settings, "ladder+self", VOCAB, draws=4)
    assert verdict.level == verdict_level, verdict.reason
    return engine


def _generate(engine: Engine, prompt: list[int], n: int, on_step: Callable[[Engine], None] | None = None) -> list[int]:
    engine.submit(Job(seq=1, prompt=prompt, max_tokens=n))
    out: list[int] = []
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, Tokens):
                out += event.tokens
        if on_step is not None:
            on_step(engine)
    return out


def test_injected_divergence_bursts_at_per_query_1_match_classic_decode_with_layout_stable_caches(
    llama: Path,
) -> None:
    """Injected: every multi-row call differs (only per-query-1 is exact). Bursts then run their
    verify at per-query-1 and emit exactly classic decode's tokens, every round audited clean, on a
    burst cache that grows in ``LAYOUT_STEP`` tokens; batched caches keep mlx-lm's step."""
    model = load_measured(llama)
    workers.kernels.seam.divergence_seam = _every_multi_row_call
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    classic = _generate(Engine(model, eos_token_ids=(0,), vocab_size=VOCAB), prompt, 40)

    engine = _engine_with_bursts(model, "per-query-1")
    steps: set[int] = set()

    def look(e: Engine) -> None:
        burst = e._burst
        if burst is not None:
            steps.update(c.step for c in burst.cache if isinstance(c, KVCache))

    assert _generate(engine, prompt, 40, look) == classic
    summary = engine.burst_summary()
    assert summary["rounds"] > 0 and summary["audits"] == summary["rounds"] and summary["audit_failures"] == 0
    assert steps == {LAYOUT_STEP}
    assert engine.ledger.snapshot()["collateral_forwards"] == 0


# --------------------------------------------------------------------------- cache layout


def test_probe_caches_keep_one_layout_through_every_draw_including_the_capacity_boundary(llama: Path) -> None:
    """Every cache the probe builds (chains and blocks) allocates its KV buffer once per draw, also
    on the draw whose keys run 255 -> 256 -> 257 (with mlx-lm's step of 256 it is re-allocated there)."""
    model = load_measured(llama)
    made: list[list[Any]] = []

    def make_cache() -> list[Any]:
        cache = make_prompt_cache(model)
        made.append(cache)
        return cache

    draws = make_draws(3, VOCAB, 4096, None)
    assert "capacity-256" in [d.name for d in draws]
    verdict = probe(model, make_cache, {"test": "layout"}, draws, 3)
    assert verdict.level == "wide" and made
    kv = [c for cache in made for c in cache if isinstance(c, KVCache)]
    assert {c.step for c in kv} == {LAYOUT_STEP}
    assert {c.keys.shape[2] for c in kv} == {LAYOUT_STEP}  # one allocation: no view ever changed layout


def test_single_sequence_forwards_get_layout_stable_caches_and_batched_ones_keep_theirs(llama: Path) -> None:
    model = load_measured(llama)
    counted = CountedModel(model, PinLedger())
    single = make_prompt_cache(model)
    counted(mx.array([[1, 2, 3]]), cache=single)
    assert {c.step for c in single} == {LAYOUT_STEP} and single[0].keys.shape[2] == LAYOUT_STEP

    parts = [make_prompt_cache(model) for _ in range(2)]
    for i, part in enumerate(parts):
        model(mx.array([[1, 2, 3 + i]]), cache=part)
    batched = merge_caches(parts)
    counted(mx.array([[4], [5]]), cache=batched)
    assert all("step" not in vars(c) and c.step == 256 for c in batched)


# --------------------------------------------------------------------------- what a verdict may hold
