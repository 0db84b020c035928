"""What a probe found, as stored: per draw, per rung, and the verdict, with their checked JSON form.

A verdict decides which kernels serve, and it is persisted (``verdict_store``), so it is read back
only when every field has its exact shape and the fields agree with each other as the probe writes
them (``Verdict.from_json``): nothing in a stored file is taken on trust.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from workers.api import Level
from workers.exact.pin_cost import PinCost
from workers.kernels import MAX_MEASURED_WIDTH


@dataclass
class DrawResult:
    draw: str
    context: int
    exact: bool
    nondeterministic: bool = False
    first_position: int | None = None
    differing_bytes: int = 0
    total_bytes: int = 0
    chain_vs_chain_bytes: int = 0
    accepted_as_classic_variation: bool = False
    seconds: float = 0.0
    first_divergence: str | None = None
    #: Projections whose width this draw's calibration narrowed (the block was then run again).
    narrowed: int = 0


@dataclass
class LevelResult:
    level: str
    exact: bool
    draws: list[DrawResult] = field(default_factory=list)
    seconds: float = 0.0
    #: Calibration at this rung: module path -> [width before, width after].
    narrowed: dict[str, list[int]] = field(default_factory=dict)
    #: Why the rung was not run (its draws are then empty).
    skipped: str | None = None


@dataclass
class Verdict:
    """The outcome for one pairing. ``level is None`` means declined: bursts must not run."""

    fingerprint: str
    pairing: dict[str, Any]
    level: str | None
    exact: bool
    reason: str
    ladder: list[LevelResult]
    probe_seconds: float
    created: float = field(default_factory=time.time)
    from_cache: bool = False
    #: The ladder as configured, cheapest first (``ladder`` holds the rungs that were reached).
    rungs: list[str] = field(default_factory=list)
    #: Width per projection path that narrow and per-query serve with (empty when no calibrated
    #: rung ran): the load-time widths as calibrated on the probe's activations.
    widths: dict[str, int] = field(default_factory=dict)
    #: What a process-wide pin would cost batched decode, per pinning rung and batch bucket
    #: (``pin_cost``): measured with the verdict, never while serving.
    pin_cost: list[PinCost] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Verdict:
        """A verdict from ``to_json``'s output; ``ValueError`` unless every field has its exact
        shape (a stored verdict decides which kernels serve, so nothing in it is taken on trust)."""
        _check(data, _VERDICT_FIELDS, "verdict")
        ladder = []
        for i, lr in enumerate(data["ladder"]):
            _check(lr, _LEVEL_FIELDS, f"verdict.ladder[{i}]")
            for j, d in enumerate(lr["draws"]):
                _check(d, _DRAW_FIELDS, f"verdict.ladder[{i}].draws[{j}]")
            draws = [DrawResult(**d) for d in lr["draws"]]
            ladder.append(LevelResult(**{**lr, "draws": draws}))
        for i, row in enumerate(data["pin_cost"]):
            _check(row, _PIN_COST_FIELDS, f"verdict.pin_cost[{i}]")
        pin_cost = [PinCost(**row) for row in data["pin_cost"]]
        verdict = cls(**{**data, "ladder": ladder, "pin_cost": pin_cost})
        verdict._check_consistent()
        return verdict

    def _check_consistent(self) -> None:
        """``ValueError`` unless the fields agree with each other as the probe writes them: the
        rungs reached are the ladder's first ones, in order; a level is a rung that ran (and passed,
        if the verdict says exact); widths are stored exactly when a calibrated rung ran, so a
        verdict at narrow or per-query never serves with widths its draws did not check."""
        reached = [lr.level for lr in self.ladder]
        if reached != self.rungs[: len(reached)]:
            raise ValueError(f"the rungs reached {reached} are not the first of the ladder {self.rungs}")
        if any(lr.skipped and lr.draws for lr in self.ladder):
            raise ValueError("a skipped rung has draws")
        ran = {lr.level: lr for lr in self.ladder if not lr.skipped}
        if self.level is not None and self.level not in ran:
            raise ValueError(f"the verdict's level {self.level} is not a rung that ran")
        if self.exact and (self.level is None or not ran[self.level].exact):
            raise ValueError("an exact verdict without an exact rung")
        calibrated = any(Level(lr.level).calibrated and lr.draws for lr in self.ladder)
        if calibrated != bool(self.widths):
            raise ValueError("widths are stored exactly when a calibrated rung ran")
        if any(r.level == Level.WIDE.value or r.level not in self.rungs for r in self.pin_cost):
            raise ValueError("a pin cost is measured only at a pinning rung of the ladder")


# What a stored verdict may hold, field by field: the persisted form is checked, never trusted.
_LEVELS = frozenset(level.value for level in Level)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _is_level(v: Any) -> bool:
    return isinstance(v, str) and v in _LEVELS


def _is_list(v: Any) -> bool:
    return isinstance(v, list)


def _is_width(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_MEASURED_WIDTH


def _is_widths(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _is_width(w) for k, w in v.items())


def _is_narrowed(v: Any) -> bool:
    def pair(p: Any) -> bool:
        return isinstance(p, list) and len(p) == 2 and all(_is_width(w) for w in p) and p[1] < p[0]

    return isinstance(v, dict) and all(isinstance(k, str) and pair(p) for k, p in v.items())


def _is_levels(v: Any) -> bool:
    return isinstance(v, list) and all(_is_level(x) for x in v)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


_DRAW_FIELDS: dict[str, Callable[[Any], bool]] = {
    "draw": _is_str,
    "context": _is_count,
    "exact": _is_bool,
    "nondeterministic": _is_bool,
    "first_position": _optional(_is_count),
    "differing_bytes": _is_count,
    "total_bytes": _is_count,
    "chain_vs_chain_bytes": _is_count,
    "accepted_as_classic_variation": _is_bool,
    "seconds": _is_seconds,
    "first_divergence": _optional(_is_str),
    "narrowed": _is_count,
}
_LEVEL_FIELDS: dict[str, Callable[[Any], bool]] = {
    "level": _is_level,
    "exact": _is_bool,
    "draws": _is_list,
    "seconds": _is_seconds,
    "narrowed": _is_narrowed,
    "skipped": _optional(_is_str),
}
_PIN_COST_FIELDS: dict[str, Callable[[Any], bool]] = {
    "level": _is_level,
    "batch": lambda v: _is_count(v) and v > 0,
    "wide_step_s": _is_seconds,
    "pinned_step_s": _is_seconds,
    "ratio": _is_seconds,
}
_VERDICT_FIELDS: dict[str, Callable[[Any], bool]] = {
    "fingerprint": _is_str,
    "pairing": lambda v: isinstance(v, dict),
    "level": _optional(_is_level),
    "exact": _is_bool,
    "reason": _is_str,
    "ladder": _is_list,
    "probe_seconds": _is_seconds,
    "created": _is_seconds,
    "from_cache": _is_bool,
    "rungs": _is_levels,
    "widths": _is_widths,
    "pin_cost": _is_list,
}


def _check(data: Any, fields: dict[str, Callable[[Any], bool]], what: str) -> None:
    """``data`` is an object with exactly ``fields``, each passing its check; else ``ValueError``."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} is not an object")
    if set(data) != set(fields):
        missing, extra = sorted(set(fields) - set(data)), sorted(map(str, set(data) - set(fields)))
        raise ValueError(f"{what} has missing fields {missing} or unknown fields {extra}")
    for name, ok in fields.items():
        if not ok(data[name]):
            raise ValueError(f"{what}.{name} is not valid: {data[name]!r:.60}")
