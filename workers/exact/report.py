"""A verdict for people: the per-draw table, the one-line ladder, and the widths calibration narrowed."""

from __future__ import annotations

from collections.abc import Iterator

from workers.exact.results import LevelResult, Verdict


def iter_table(verdict: Verdict) -> Iterator[tuple[str, str, str, str, str]]:
    """Rows of (level, result, first position, draw, seconds) for printing: every rung reached,
    in ladder order, the winning one marked ``(won)``."""
    deciding = _deciding_rung(verdict)
    for lr in verdict.ladder:
        name = f"{lr.level} (won)" if lr is deciding else lr.level
        if lr.skipped:
            yield name, f"skipped: {lr.skipped}", "-", "-", "0.00"
        for d in lr.draws:
            if d.exact:
                result = "exact"
            elif d.nondeterministic:
                result = f"nondeterministic: block {d.differing_bytes} / chain-vs-chain {d.chain_vs_chain_bytes} of {d.total_bytes} B"
            else:
                result = f"{d.differing_bytes} / {d.total_bytes} B differ"
            if d.first_divergence:
                result += f" (first: {d.first_divergence})"
            if d.narrowed:
                result += f" (calibration narrowed {d.narrowed} projection widths)"
            pos = "-" if d.first_position is None else str(d.first_position)
            yield name, result, pos, f"{d.draw} ({d.context} tok)", f"{d.seconds:.2f}"


def _deciding_rung(verdict: Verdict) -> LevelResult | None:
    """The rung that passed and gave the verdict its level (``None`` when none did: declined, or a
    level the operator forced onto a rung that differs)."""
    return next((lr for lr in verdict.ladder if lr.level == verdict.level and lr.exact and not lr.skipped), None)


def ladder_line(verdict: Verdict) -> str:
    """One line for people: every rung of the ladder and how it ended, e.g.
    ``wide: differs -> narrow: differs -> per-query: skipped -> per-query-1: exact (won)``."""
    reached = {lr.level: lr for lr in verdict.ladder}
    deciding = _deciding_rung(verdict)
    parts = []
    for rung in verdict.rungs or [lr.level for lr in verdict.ladder]:
        lr = reached.get(rung)
        if lr is None:
            state = "not needed" if verdict.exact else "not run"
        elif lr.skipped:
            state = "skipped"
        elif lr.exact:
            state = "exact" if verdict.exact else "accepted"
        elif any(d.nondeterministic for d in lr.draws):
            state = "classic not reproducible"
        else:
            state = "differs"
        parts.append(f"{rung}: {state}" + (" (won)" if lr is not None and lr is deciding else ""))
    return " -> ".join(parts)


def narrowed_widths(verdict: Verdict) -> dict[str, list[int]]:
    """Every projection the probe's calibration narrowed: path -> [load-time width, served width]."""
    out: dict[str, list[int]] = {}
    for lr in verdict.ladder:
        for path, (before, after) in lr.narrowed.items():
            out[path] = [out.get(path, [before])[0], after]
    return out


def pin_cost_line(verdict: Verdict) -> str | None:
    """One line for people: what a process-wide pin would cost batched decode, per rung and batch
    size (``None`` where nothing was measured)."""
    if not verdict.pin_cost:
        return None
    levels = dict.fromkeys(r.level for r in verdict.pin_cost)
    parts = [
        f"{lv} " + ", ".join(f"B={r.batch} {r.ratio:.2f}x" for r in verdict.pin_cost if r.level == lv) for lv in levels
    ]
    return "a process-wide pin would cost batched decode (pinned / wide): " + "; ".join(parts)
