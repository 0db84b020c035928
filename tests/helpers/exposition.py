"""A strict reader of the Prometheus text exposition (what ``promtool check metrics`` refuses, in the
parts that matter here): each family's HELP and TYPE once, before its samples; a family's samples
together; every sample named as its family's type allows; no name claimed by two families."""

from __future__ import annotations

import re

_SUFFIXES = {
    "counter": ("", "_total"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "untyped": ("",),
    "info": ("_info",),
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+\S+(\s+\S+)?$")


def strict_problems(text: str) -> list[str]:
    """Every way ``text`` breaks the rules above, one line each (empty when it is valid)."""
    problems: list[str] = []
    helps: set[str] = set()
    types: dict[str, str] = {}
    owner: dict[str, str] = {}  # sample name -> its family
    finished: set[str] = set()
    current: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            parts = line.split(" ", 3)
            if len(parts) < 4:
                problems.append(f"line {n}: malformed {line!r}")
                continue
            kind, name = parts[1], parts[2]
            if kind == "HELP":
                if name in helps:
                    problems.append(f"line {n}: second HELP for {name}")
                helps.add(name)
            else:
                if name in types:
                    problems.append(f"line {n}: second TYPE for {name}")
                if parts[3] not in _SUFFIXES:
                    problems.append(f"line {n}: unknown type {parts[3]!r}")
                types[name] = parts[3]
                for suffix in _SUFFIXES.get(parts[3], ()):
                    claimed = owner.setdefault(name + suffix, name)
                    if claimed != name:
                        problems.append(f"line {n}: {name + suffix} belongs to {claimed} and {name}")
            if current is not None and current != name:
                finished.add(current)
            if name in finished:
                problems.append(f"line {n}: family {name} continues after another family")
            current = name
            continue
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            problems.append(f"line {n}: not a sample {line!r}")
            continue
        family = owner.get(match.group(1))
        if family is None:
            problems.append(f"line {n}: sample {match.group(1)} of no declared family")
        elif family != current:
            problems.append(f"line {n}: sample {match.group(1)} outside its family {family}")
    return problems


#: The ``vllm:`` families a daemon exposes (as vLLM names and types them), and for each histogram the
#: daemon's own family it mirrors.
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}
VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "mlx_batchd_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "mlx_batchd_inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds": "mlx_batchd_inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds": "mlx_batchd_request_duration_seconds",
}
