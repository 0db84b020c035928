"""The per-token metrics, counted as plain numbers on the event loop and turned into Prometheus
families only when scraped.

Every token a daemon streams adds an inter-token gap to a histogram and one to the generated-tokens
counter. Through ``prometheus_client`` that was a ``Histogram.observe`` (a lock and a bucket scan)
and a ``Counter.labels(...).inc`` per token: ~40 % of what the front end's event loop spent on a
token (profiled by thread CPU, 128 streams on the development CPU). Here a step's tokens for one
request cost one bisect and a few additions: a burst's or a step's tokens share one gap, so
``observe`` takes a count. The exposition is the same families, names and buckets.

The event loop writes; the HTTP server's thread reads at a scrape. A scrape copies the lists (under
the GIL, in C); a scrape that lands between a gap's bucket and its sum sees the sum one gap behind.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class Counts(Collector):
    """An inter-token histogram and generated tokens by mode (see the module's docstring)."""

    def __init__(self, prefix: str, buckets: Sequence[float]) -> None:
        self._prefix = prefix
        self._bounds = tuple(buckets)
        #: Per bucket (the last is +Inf): gaps that fell in it, not cumulative.
        self._in_bucket = [0] * (len(self._bounds) + 1)
        self._gap_sum = 0.0
        self._generated: dict[str, int] = {}

    def observe_gap(self, seconds: float, tokens: int = 1) -> None:
        """``tokens`` tokens that each came ``seconds`` after the one before (``le`` is inclusive)."""
        self._in_bucket[bisect_left(self._bounds, seconds)] += tokens
        self._gap_sum += seconds * tokens

    def generated(self, mode: str, tokens: int) -> None:
        self._generated[mode] = self._generated.get(mode, 0) + tokens

    def collect(self) -> Iterator[Metric]:
        in_bucket, gap_sum, generated = list(self._in_bucket), self._gap_sum, dict(self._generated)
        cumulative, total = [], 0
        for bound, n in zip((*map(_le, self._bounds), "+Inf"), in_bucket, strict=True):
            total += n
            cumulative.append((bound, total))
        yield HistogramMetricFamily(
            f"{self._prefix}_inter_token_latency_seconds",
            "Between a request's tokens (a burst's tokens share its gap)",
            buckets=cumulative,
            sum_value=gap_sum,
        )
        family = CounterMetricFamily(
            f"{self._prefix}_generated_tokens", "Generated tokens by how they were produced", labels=["mode"]
        )
        for mode, n in sorted(generated.items()):
            family.add_metric([mode], n)
        yield family


def _le(bound: float) -> str:
    """A bucket's bound as ``prometheus_client`` writes it (``0.001``, ``1.0``)."""
    return repr(float(bound))
