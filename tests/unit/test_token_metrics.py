"""``scheduler.token_metrics.Counts`` exposes what ``prometheus_client``'s own histogram and counter
expose for the same tokens (the reference), a step's tokens counted at once."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram

from scheduler.observations import LATENCY_BUCKETS
from scheduler.token_metrics import Counts


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_the_counts_expose_what_prometheus_client_would() -> None:
    reference, ours = CollectorRegistry(), CollectorRegistry()
    itl = Histogram("p_inter_token_latency_seconds", "x", registry=reference, buckets=LATENCY_BUCKETS)
    generated = Counter("p_generated_tokens", "x", ["mode"], registry=reference)
    counts = Counts("p", LATENCY_BUCKETS)
    ours.register(counts)
    rng = random.Random(7)
    gaps = [*LATENCY_BUCKETS, 0.0, 1e-6, 120.0]  # on every bound (inclusive), under and over them
    gaps += [rng.choice([rng.uniform(0, 0.05), rng.uniform(0, 70)]) for _ in range(300)]
    for gap in gaps:
        tokens = rng.choice([1, 1, 1, 3, 7])  # a burst's tokens share their gap
        mode = rng.choice(["batched", "burst"])
        for _ in range(tokens):
            itl.observe(gap)
        generated.labels(mode).inc(tokens)
        counts.observe_gap(gap, tokens)
        counts.generated(mode, tokens)
    want, got = _samples(reference), _samples(ours)
    assert set(got) == set(want)
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


def test_nothing_observed_yet() -> None:
    registry = CollectorRegistry()
    registry.register(Counts("p", (0.1, 1.0)))
    got = _samples(registry)
    assert got[("p_inter_token_latency_seconds_count", ())] == 0
    assert got[("p_inter_token_latency_seconds_bucket", (("le", "+Inf"),))] == 0
    assert not any(name.startswith("p_generated_tokens") for name, _ in got)
