"""The ``vllm:`` aliases of the serving metrics, read off a real exposition of a ``stats`` reply and
of observed latencies (no daemon): vLLM's names, types and labels, this daemon's numbers."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.exposition import metrics_app
from scheduler.observations import Observations
from tests.helpers.exposition import VLLM_FAMILIES, VLLM_HISTOGRAMS, strict_problems
from tests.helpers.stats import stats_snapshot

LABELS = (("engine", "0"), ("model_name", "m"))


def _expose(stats: dict[str, object], model: str | None) -> str:
    obs = Observations()
    obs.ttft.observe(0.02)
    obs.ttft.observe(0.3)
    obs.e2e.observe(1.5)
    obs.tokens.observe_gap(0.01, 4)
    metrics_app(lambda: stats, obs.registry, model=lambda: model, observations=obs)
    return generate_latest(obs.registry).decode()


def test_the_aliases_carry_the_daemons_numbers_under_vllms_names() -> None:
    stats = dict(stats_snapshot(uptime=12.0, generated=1600, emitted=500, drafted=400, accepted=300))
    stats.update(requests_waiting=3, kv_reserved_bytes=256, kv_budget_bytes=1024)
    text = _expose(stats, "m")
    assert strict_problems(text) == [], text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    engine = stats["engine"]
    assert isinstance(engine, dict)
    assert got[("vllm:num_requests_running", LABELS)] == engine["active_sequences"]
    assert got[("vllm:num_requests_waiting", LABELS)] == 3
    assert got[("vllm:kv_cache_usage_perc", LABELS)] == 0.25
    assert got[("vllm:prompt_tokens_total", LABELS)] == 40
    assert got[("vllm:generation_tokens_total", LABELS)] == 1600
    types = {name: families[name].type for name in families if name.startswith("vllm:")}
    assert types == VLLM_FAMILIES
    # The histograms are the daemon's own observations, bucket for bucket.
    for alias, own in VLLM_HISTOGRAMS.items():
        mine = {(s.name[len(own) :], s.labels.get("le")): s.value for s in families[own].samples}
        theirs = {(s.name[len(alias) :], s.labels.get("le")): s.value for s in families[alias].samples}
        assert theirs == {k: v for k, v in mine.items() if k[0] != "_created"}, alias
        assert all(s.labels["model_name"] == "m" and s.labels["engine"] == "0" for s in families[alias].samples)
    assert got[("vllm:time_to_first_token_seconds_count", LABELS)] == 2
    assert got[("vllm:inter_token_latency_seconds_count", LABELS)] == 4


def test_without_a_budget_the_usage_is_zero_and_while_loading_no_samples() -> None:
    stats = dict(stats_snapshot(uptime=1.0, generated=0, emitted=0, drafted=0, accepted=0))
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(_expose(stats, "m"))
        for s in f.samples
    }
    assert got[("vllm:kv_cache_usage_perc", LABELS)] == 0.0
    loading = _expose(stats, None)  # no model name yet: the families are declared, empty
    assert strict_problems(loading) == []
    assert "# TYPE vllm:num_requests_running gauge" in loading
    assert not any(line.startswith("vllm:") for line in loading.splitlines())
