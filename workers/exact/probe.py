"""The exactness probe: is a verify block byte-identical to classic decode, and at what level?

For a pairing (target, drafter, K drafted tokens) the verify forward runs a block of ``K + 1``
tokens (the last accepted token and K drafts). The probe compares the **chain** (``K + 1``
single-token forwards, classic decode: wide, or the rung itself for one that pins the chain) with
the **block** (one forward at a kernel level) on fresh caches built as serving builds them, with a layout-stable growth step
(``kernels.LAYOUT_STEP``, as bursts get), byte for byte over every position's full logit row.
Draws are chosen where divergences hide: short prompts, a block whose keys run 255 -> 256 -> 257
(mlx-lm's capacity step, where kernels have shown key-length effects), and a long context past the
sliding window (or >= 1024 tokens).

Classic decode is run twice first: a draw whose chain does not reproduce is ``nondeterministic``
and is declined unless the operator accepts "no worse than classic's own variation".

The ladder tries wide, narrow, per-query, per-query-1 (``kernels.ladder()``; on MLX CUDA padded
comes right after wide); the verdict is the first exact rung, or
declined (fail closed). At narrow and per-query every draw's block is run with its projections'
inputs captured, and each width is verified on those rows (``kernels.calibrate``): a width that
does not hold is narrowed and the block run again, so the widths a verdict carries held on the
probe's own activations. When calibration has left every projection at one row, per-query is
per-query-1 and is reported as that rung. Verdicts (with their widths) are memoised by a
fingerprint of everything that can change the answer and persisted as JSON.

This module turns a pairing into a verdict (from the store, or by running the ladder a forward per
step). The parts: ``draws`` (the draws, and running one), ``ladder`` (the rungs and the policy),
``localize`` (naming the first sublayer that differs), ``results`` (the verdict and its checked
JSON), ``verdict_store`` (fingerprints and the files), ``report`` (the verdict for people).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import asdict
from typing import Any

from workers.api import Level, ProbePolicy
from workers.exact.draws import Draw, MakeCache, make_draws, sliding_window
from workers.exact.ladder import ladder_steps
from workers.exact.pin_cost import pin_cost_steps, pinning_rungs
from workers.exact.results import Verdict
from workers.exact.verdict_store import VerdictStore, pairing_fingerprint
from workers.exact.verify_warmup import warm_steps
from workers.kernels import LAYOUT_STEP, PAD_ROWS, apply_widths, drive, levels, widths_by_path

#: The default policy: exact or declined, nothing pinned.
_DEFAULT_POLICY = ProbePolicy()

__all__ = [
    "ProbePolicy",
    "Verdict",
    "drive",
    "failed_verdict",
    "make_draws",
    "probe",
    "probe_steps",
    "sliding_window",
]


def probe_steps(
    model: Any,
    make_cache: MakeCache,
    pairing: dict[str, Any],
    draws: list[Draw],
    k: int,
    store: VerdictStore | None = None,
    policy: ProbePolicy = _DEFAULT_POLICY,
    force: bool = False,
    warm: list[int] | None = None,
    max_batch: int | None = None,
) -> Generator[str, None, Verdict]:
    """The verdict for ``pairing`` (a JSON-able description including the model's fingerprint,
    the drafter and the backend), from the store when its fingerprint is known, else measured a
    forward per step (a prefill chunk, a decode step, a block, a pin-cost step; any pin entered and
    left within its step, so an engine serves between the steps at its own level). Either way the verdict's widths are what narrow and per-query serve with after it.
    With ``warm`` (a verdict that bursts will serve: the block lengths they can run) the verify's
    kernels are built at the verdict's level for those lengths before it is returned (``verify_warmup``).
    ``max_batch``: a serving engine's most sequences a step; the pin's cost is measured up to it."""
    verdict = yield from _verdict_steps(model, make_cache, pairing, draws, k, store, policy, force, max_batch)
    if warm and verdict.level is not None:
        yield from warm_steps(model, make_cache, Level(verdict.level), warm, draws[0].prompt)
    return verdict


def _verdict_steps(
    model: Any,
    make_cache: MakeCache,
    pairing: dict[str, Any],
    draws: list[Draw],
    k: int,
    store: VerdictStore | None,
    policy: ProbePolicy,
    force: bool,
    max_batch: int | None = None,
) -> Generator[str, None, Verdict]:
    full = {
        **pairing,
        "k": k,
        "policy": {k2: str(v) for k2, v in asdict(policy).items()},
        "draws": [(d.name, len(d.prompt)) for d in draws],
        "layout_step": LAYOUT_STEP,
        "pad_rows": PAD_ROWS,
    }
    fp = pairing_fingerprint(full)
    if store is not None and not force:
        cached = store.get(fp)
        if cached is not None:
            apply_widths(model, cached.widths)
            return cached
    tic = time.perf_counter()
    rungs = (policy.pinned_level,) if policy.pinned_level is not None else levels.ladder()
    level, exact, reason, ladder = yield from ladder_steps(model, make_cache, draws, k, policy, rungs)
    verdict = Verdict(
        fp,
        full,
        None if level is None else level.value,
        exact,
        reason,
        ladder,
        time.perf_counter() - tic,
        rungs=[r.value for r in rungs],
    )
    if any(Level(lr.level).calibrated and lr.draws for lr in ladder):
        verdict.widths = widths_by_path(model)
    apply_widths(model, verdict.widths)
    pinning = pinning_rungs(verdict.rungs, [lr.level for lr in ladder if lr.skipped])
    verdict.pin_cost = yield from pin_cost_steps(model, make_cache, draws[0].prompt, pinning, max_batch)
    if store is not None:
        store.put(verdict)
    return verdict


def failed_verdict(name: str, exc: BaseException) -> Verdict:
    """A probe that raised: declined, with the error as the reason (fail closed)."""
    return Verdict("", {"pairing": name}, None, False, f"declined: the probe failed: {exc!r}", [], 0.0)


def probe(
    model: Any,
    make_cache: MakeCache,
    pairing: dict[str, Any],
    draws: list[Draw],
    k: int,
    store: VerdictStore | None = None,
    policy: ProbePolicy = _DEFAULT_POLICY,
    progress: Callable[[str], None] | None = None,
    force: bool = False,
) -> Verdict:
    return drive(probe_steps(model, make_cache, pairing, draws, k, store, policy, force), progress)
