"""vLLM's names for the common serving metrics (``vllm:``), read from the same published ``stats``
snapshot and observed distributions as the daemon's own families."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler.observations import Observations
from scheduler.stats_types import engine_of, read_stats

#: The labels vLLM puts on its serving metrics: the served model's name and the engine's index.
VLLM_LABELS = ["model_name", "engine"]


class VllmAliases(Collector):
    """vLLM's names for the common serving metrics, so dashboards made for vLLM read this daemon:
    the same numbers as the ``mlx_batchd_`` families (running and waiting requests, KV cache usage,
    prompt and generation tokens, time to first token, inter-token and end-to-end latency), under
    vLLM's names, types and labels (``model_name``, ``engine="0"``). Histograms keep this daemon's
    buckets. Every family is declared from the first scrape; its samples come once the model is
    loaded (they need its name)."""

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, Any]],
        model: Callable[[], str | None],
        observations: Observations | None,
    ) -> None:
        self._snapshot, self._model, self._obs = snapshot, model, observations

    def collect(self) -> Iterator[Metric]:
        published, name = self._snapshot(), self._model()
        labels = None if not published or name is None else [name, "0"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels=VLLM_LABELS
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=VLLM_LABELS
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage (of kv_budget_mb; 0 without a budget).",
            labels=VLLM_LABELS,
        )
        prompt = CounterMetricFamily("vllm:prompt_tokens", "Number of prefill tokens processed.", labels=VLLM_LABELS)
        generation = CounterMetricFamily(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels=VLLM_LABELS
        )
        if labels is not None:
            s = read_stats(published)
            engine = engine_of(s)
            running.add_metric(labels, 0 if engine is None else engine["active_sequences"])
            waiting.add_metric(labels, s["requests_waiting"])
            budget = s["kv_budget_bytes"]
            usage.add_metric(labels, s["kv_reserved_bytes"] / budget if budget > 0 else 0.0)
            prompt.add_metric(labels, sum(t["served_prompt_tokens"] for t in s["tenants"].values()))
            generation.add_metric(labels, sum(t["served_generated_tokens"] for t in s["tenants"].values()))
        yield from (running, waiting, usage, prompt, generation)
        obs = self._obs
        ttft, tokens, e2e = (None, None, None) if obs is None else (obs.ttft, obs.tokens, obs.e2e)
        histograms: tuple[tuple[str, str, Collector | None], ...] = (
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttft),
            ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", tokens),
            (
                "time_per_output_token_seconds",
                "Histogram of time per output token in seconds (the inter-token latency, vLLM's older name).",
                tokens,
            ),
            ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", e2e),
        )
        for name_, help_, source in histograms:
            family = HistogramMetricFamily(f"vllm:{name_}", help_, labels=VLLM_LABELS)
            if labels is not None and source is not None:
                buckets, total = _histogram_of(source)
                family.add_metric(labels, buckets, total)
            yield family


def _histogram_of(source: Collector) -> tuple[list[tuple[str, float]], float]:
    """The cumulative buckets and the sum of the first (unlabelled) histogram ``source`` collects."""
    metric = next(iter(source.collect()))
    buckets = [(s.labels["le"], s.value) for s in metric.samples if s.name.endswith("_bucket")]
    total = next(s.value for s in metric.samples if s.name.endswith("_sum"))
    return buckets, total
