"""Distributions the event loop observes as things happen (latencies, batch sizes, per-token gaps):
what a published snapshot cannot give, percentiles."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from scheduler.metrics import PREFIX

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Observations:
    """Distributions observed as things happen (a snapshot cannot give percentiles). The metric
    objects are thread-safe; the event loop observes, and scrapes read them on the same loop."""

    def __init__(self) -> None:
        from prometheus_client import Histogram

        from scheduler.token_metrics import Counts

        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From submit read to first token",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            f"{PREFIX}_request_duration_seconds", "From submit read to the end", registry=r, buckets=LATENCY_BUCKETS
        )
        self.queue = Histogram(
            f"{PREFIX}_queue_time_seconds", "From submit read to prefill start", registry=r, buckets=LATENCY_BUCKETS
        )
        self.step = Histogram(
            f"{PREFIX}_step_seconds", "Engine step time by kind", ["kind"], registry=r, buckets=LATENCY_BUCKETS
        )
        self.batch = Histogram(
            f"{PREFIX}_batch_size", "Sequences per batched decode step", registry=r, buckets=BATCH_BUCKETS
        )
        #: The per-token families (inter-token gaps, generated tokens by mode) as plain counts.
        self.tokens = Counts(PREFIX, LATENCY_BUCKETS)
        r.register(self.tokens)
