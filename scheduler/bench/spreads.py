"""Medians' spreads and the arms' order: how every bench reports a figure (median, min-max), a ratio
(the range its two arms' samples allow) and rotates its arms so that no arm always runs first."""

from __future__ import annotations

import statistics


def spread(xs: list[float]) -> list[float]:
    """The samples' range, ``[min, max]``."""
    return [min(xs), max(xs)]


def ratio_spread(arm: list[float], base: list[float]) -> list[float]:
    """The range of ``arm / base`` that the two arms' samples allow: ``[min(arm) / max(base),
    max(arm) / min(base)]``. It holds 1.0 whenever the two spreads overlap, so an arm doing the same
    work as ``base`` reads 1.00 within it unless every one of its samples beat (or lost to) every
    sample of ``base``, which is the mark of arms not measured alike."""
    return [min(arm) / max(base), max(arm) / min(base)]


def paired_ratio(arm: list[float], base: list[float]) -> tuple[float, list[float]] | None:
    """Median and range of ``arm[i] / base[i]``: each repeat's two runs, taken within a few seconds of
    each other, as one ratio. A host that drifts over a bench moves both runs of a repeat alike, where
    it widens each arm's own spread (a GPU host's speed drifts by tens of percent within minutes).
    ``None`` unless both have one sample a repeat."""
    if not arm or len(arm) != len(base):
        return None
    ratios = [a / b for a, b in zip(arm, base, strict=True)]
    return statistics.median(ratios), spread(ratios)


def rotated(arms: list[str], repeat: int) -> list[str]:
    """The arms' order in one repeat: shifted by one each repeat, so every arm takes every position
    (first, right after this process's own GPU work, last) as often as the others."""
    k = repeat % len(arms)
    return arms[k:] + arms[:k]


def with_spread(value: float | None, lohi: list[float] | None, fmt: str) -> str:
    """``median (min-max)``, or ``-`` for an arm not run at that B."""
    if value is None or lohi is None:
        return "-"
    lo, hi = lohi
    return f"{value:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"
