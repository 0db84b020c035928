"""``mlx-batchd bench``: the workload matrix, one command.

Batched decode throughput vs B through the daemon (scoped pins), through a daemon with a process-wide
pin (``--process-pin``), through the same daemon's OpenAI-compatible HTTP door (``--via http``: whole
answers and SSE streams), through the engine alone and through raw ``BatchGenerator``; B = 1 classic vs
bursts per drafter (``--drafters``, one daemon each); mixed Poisson arrivals with TTFT / inter-token
percentiles; the start-up probe's time per daemon. JSON, Markdown tables and PNG plots land in
``--out``, rewritten after every batch size, so a run stopped by an outer timeout keeps what it finished.
``--prefix-scenario`` runs the prefix cache scenario instead (``run_prefix``: TTFT of a shared prefix
cold vs warm, a multi-turn chat's prefill, throughput with no hit, each through a daemon with the cache
and one without).

Every arm runs the same workload: B greedy sequences with the same random prompts, every request
submitted at once, timed from the first submit to the last token. The raw and engine arms run in
this process; the daemon arms drive daemon child processes through the client library, and the HTTP
arms the daemon arm's own daemon through ``httpx`` with the same token ids, as a user would. Arms
are measured alike, so that an arm that does the same work as another reads 1.00 of it:

- one arm works at a time, and before each timed run every daemon is idle (start-up probe done,
  no sequence in its engine), checked by asking it rather than assumed;
- every B = 1 arm first runs one untimed request of the measured shape (prompt and output length),
  so kernel compilation, allocator growth and the KV cache's growth steps are paid before timing in
  every daemon alike, not by whichever daemon had no start-up probe to pay them;
- the arms' order rotates by one each repeat, so no arm always runs first or right after this
  process's own GPU work, and drift in the machine's speed hits every arm alike.

Each figure is the median of the repeats with its spread (min-max); a ratio's spread is the range
its two arms' samples allow. A drafter arm whose bursts did not run (declined verdict, or no round)
is reported as declined, with its ratio and spread, never as a speedup.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast


def _prompts(b: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, min(vocab, 256)) for _ in range(n)] for _ in range(b)]


def write_whole(path: Path, text: str) -> None:
    """Whole or not at all: a run stopped mid-write keeps the previous version, never half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_png(fig: Any, path: Path) -> None:
    """``write_whole`` for a figure; the figure is closed so that rewriting after every batch size
    does not pile figures up."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.tight_layout()
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def progress(line: str) -> None:
    """One line per step, flushed at once: a long run's log shows where it is even when piped."""
    print(line, flush=True)


def run_raw(model: Any, eos: list[int], prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Generated tokens and seconds for one workload on a fresh ``BatchGenerator``, on stock MLX and
    mlx-lm (the project's kernel patches are lifted for the run): the peer, as mlx_lm.server runs it."""
    from mlx_lm.generate import BatchGenerator

    from workers.kernels import stock

    with stock():
        gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in eos],
            completion_batch_size=max(32, len(prompts)),
            prefill_batch_size=8,
        )
        tic = time.perf_counter()
        gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        produced = 0
        while responses := gen.next_generated():
            produced += sum(1 for r in responses if r.finish_reason != "stop")
        wall = time.perf_counter() - tic
        gen.close()
    return produced, wall


STEP_COUNTERS = ("steps", "step_seconds", "decode_steps", "decode_seconds")


def step_counters(engine_stats: dict[str, Any]) -> dict[str, float]:
    """The engine's step counters from its stats (``stats.engine`` or ``asdict(counters)``)."""
    return {k: engine_stats.get(k, 0) for k in STEP_COUNTERS}


def run_engine(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """The project's engine in this process, no front end and no sockets: the daemon's ceiling."""
    from workers.engine import Job, Tokens

    tic = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(Job(seq=i, prompt=p, max_tokens=max_tokens))
    produced = 0
    while engine.has_work:
        produced += sum(len(e.tokens) for e in engine.step() if isinstance(e, Tokens))
    return produced, time.perf_counter() - tic


def reference_tok_s(weight_bytes: int, kv_bytes_per_token: int, context: int, batch: int, gb_per_s: float) -> float:
    """The physical limit of a decode step: every weight byte and each sequence's KV read once per
    step at the memory bandwidth; ``batch`` tokens come out of each step."""
    step_bytes = weight_bytes + batch * kv_bytes_per_token * context
    return batch * gb_per_s * 1e9 / step_bytes


def run_daemon(client: Any, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    tic = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: client.generate(tokens=p, max_tokens=max_tokens), prompts))
    wall = time.perf_counter() - tic
    return sum(r.usage["completion_tokens"] for r in results), wall


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a daemon's ``--http``: the daemon prints its address but
    the bench does not read its output, so the bench picks the port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _completion_body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    """The ZeroMQ arm's request as an OpenAI completion: the same token ids (``prompt`` as a token
    list), the same budget, greedy; a stream asks for its usage so tokens are counted as the daemon
    counted them."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def http_generate(http: Any, model: str, prompt: list[int], max_tokens: int, stream: bool) -> int:
    """One completion through the HTTP door with ``http`` (an ``httpx.Client``); its completion
    tokens, from the answer's ``usage`` (a stream's last chunk)."""
    body = _completion_body(model, prompt, max_tokens, stream)
    if not stream:
        reply = http.post("/v1/completions", json=body)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])
    usage = None
    with http.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the HTTP stream ended with an error: {chunk['error']}")
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("the HTTP stream ended without its usage chunk")
    return int(usage["completion_tokens"])


def run_http(http: Any, model: str, prompts: list[list[int]], max_tokens: int, stream: bool) -> tuple[int, float]:
    """``run_daemon`` through the HTTP door: every request at once, one thread each, as the ZeroMQ
    arm submits them, on one connection pool."""
    tic = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        produced = list(pool.map(lambda p: http_generate(http, model, p, max_tokens, stream), prompts))
    return sum(produced), time.perf_counter() - tic


def open_http(url: str) -> Any:
    """An ``httpx.Client`` for the HTTP arms: no cap on pooled connections (every request of a batch
    holds one at once), no timeout a long run could hit."""
    import httpx

    return httpx.Client(
        base_url=url,
        timeout=3600,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


def served_model(http: Any) -> str:
    """The served model's id, as a stock client finds it: ``GET /v1/models``."""
    reply = http.get("/v1/models")
    reply.raise_for_status()
    return str(reply.json()["data"][0]["id"])


#: The HTTP arms (``--via http``): the ``daemon`` arm's own daemon through its HTTP door, whole
#: answers and SSE streams; arm -> stream.
HTTP_ARMS = {"http": False, "http_stream": True}


def run_poisson(address: str, rate: float, n: int, vocab: int, max_tokens: int, seed: int = 7) -> dict[str, Any]:
    """Mixed arrivals: ``n`` requests at Poisson times (``rate`` per second), random prompt lengths
    and budgets, through one async client; client-side TTFT, inter-token gaps and durations."""
    import anyio

    from clients.client import AsyncClient
    from clients.events import TokenEvent

    rng = random.Random(seed)
    plan = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        plan.append(
            (
                t,
                [rng.randrange(4, min(vocab, 256)) for _ in range(rng.randrange(4, 64))],
                rng.randrange(8, max_tokens + 1),
            )
        )
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []

    async def one(client: AsyncClient, at: float, prompt: list[int], budget: int, start: float) -> None:
        await anyio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = last = time.perf_counter()
        first = True
        async for ev in client.stream(tokens=prompt, max_tokens=budget):
            if isinstance(ev, TokenEvent) and ev.tokens:
                now = time.perf_counter()
                if first:
                    ttft.append(now - sent)
                    first = False
                else:
                    itl.extend([(now - last) / len(ev.tokens)] * len(ev.tokens))
                last = now
        e2e.append(time.perf_counter() - sent)

    async def main() -> None:
        async with AsyncClient(address, timeout=3600) as client:
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for at, prompt, budget in plan:
                    tg.start_soon(one, client, at, prompt, budget, start)

    anyio.run(main, backend="asyncio")

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {
        "rate": rate,
        "requests": n,
        **{
            f"{name}_p{int(q * 100)}": pct(xs, q)
            for name, xs in (("ttft", ttft), ("itl", itl), ("e2e", e2e))
            for q in (0.5, 0.9, 0.99)
        },
        "samples": {"ttft": ttft, "itl": itl},
    }


def write_poisson(result: dict[str, Any], meta: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    write_whole(out / "poisson.json", json.dumps({"meta": meta, "result": result}, indent=2))
    md = "| metric | p50 | p90 | p99 |\n|---|---|---|---|\n" + "".join(
        f"| {name} (ms) | {result[f'{name}_p50'] * 1e3:.1f} | {result[f'{name}_p90'] * 1e3:.1f} | {result[f'{name}_p99'] * 1e3:.1f} |\n"
        for name in ("ttft", "itl", "e2e")
    )
    write_whole(out / "poisson.md", md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("ttft", "itl"):
        xs = sorted(result["samples"][name])
        if xs:
            ax.plot([x * 1e3 for x in xs], [i / len(xs) for i in range(len(xs))], label=name)
    ax.set(
        xscale="log",
        xlabel="milliseconds",
        ylabel="fraction of samples",
        title=f"{result['requests']} Poisson arrivals at {result['rate']}/s, {meta['model']}",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    save_png(fig, out / "poisson.png")
    return md


def spread(xs: list[float]) -> list[float]:
    """The samples' range, ``[min, max]``."""
    return [min(xs), max(xs)]


def ratio_spread(arm: list[float], base: list[float]) -> list[float]:
    """The range of ``arm / base`` that the two arms' samples allow: ``[min(arm) / max(base),
    max(arm) / min(base)]``. It holds 1.0 whenever the two spreads overlap, so an arm doing the same
    work as ``base`` reads 1.00 within it unless every one of its samples beat (or lost to) every
    sample of ``base``, which is the mark of arms not measured alike."""
    return [min(arm) / max(base), max(arm) / min(base)]


def rotated(arms: list[str], repeat: int) -> list[str]:
    """The arms' order in one repeat: shifted by one each repeat, so every arm takes every position
    (first, right after this process's own GPU work, last) as often as the others."""
    k = repeat % len(arms)
    return arms[k:] + arms[:k]


def reference_line(weight_bytes: int, kv_bytes_per_token: int, context: int, batch: int, gb_per_s: float) -> str:
    """The physical reference in words: what one decode step reads and the rate that allows."""
    kv = batch * kv_bytes_per_token * context
    each = "" if batch == 1 else f" for each of {batch} sequences"
    return (
        f"physical limit at B = {batch}: {weight_bytes / 1e9:.3f} GB of weights + {kv / 1e6:.3f} MB of KV "
        f"({context} tokens of context{each}) read per step at {gb_per_s:g} GB/s = "
        f"{reference_tok_s(weight_bytes, kv_bytes_per_token, context, batch, gb_per_s):.1f} tok/s"
    )


@dataclass(frozen=True)
class Setup:
    """What one run measures, and the figures its tables need besides the samples."""

    batches: tuple[int, ...]
    #: Measured at every B: raw, engine, daemon and, with ``--process-pin``, daemon_process_pin;
    #: with ``--via http``, http and http_stream (``HTTP_ARMS``).
    arms: tuple[str, ...]
    #: ``bursts:<drafter>``, one daemon each, measured at B = 1 only.
    b1_arms: tuple[str, ...] = ()
    repeats: int = 1
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    #: The mean context over a sequence's decode (prompt + half the output), for the reference.
    context: int = 0
    #: Memory bandwidth for the physical reference; ``None`` omits it.
    gb_per_s: float | None = None
    #: The raw arm runs only up to this B (``None``: at every B). On MLX CUDA its stock path costs
    #: 30 s per run at B = 128 and is flat past B = 32.
    raw_max_batch: int | None = None

    def batched_arms(self, batch: int) -> list[str]:
        """The arms measured at ``batch`` among ``arms``."""
        return [a for a in self.arms if a != "raw" or self.raw_max_batch is None or batch <= self.raw_max_batch]

    def arms_at(self, batch: int) -> list[str]:
        return [*self.batched_arms(batch), *(self.b1_arms if batch == 1 else ())]

    def finished(self, samples: dict[tuple[str, int], list[float]]) -> list[int]:
        """The batch sizes whose every arm has all its repeats."""
        return [b for b in self.batches if all(len(samples.get((a, b), ())) >= self.repeats for a in self.arms_at(b))]

    def reference(self, batch: int) -> float | None:
        if not self.gb_per_s:
            return None
        return reference_tok_s(self.weight_bytes, self.kv_bytes_per_token, self.context, batch, self.gb_per_s)

    def reference_line(self, batch: int) -> str | None:
        if not self.gb_per_s:
            return None
        return reference_line(self.weight_bytes, self.kv_bytes_per_token, self.context, batch, self.gb_per_s)


#: The batched table's ratios: (key, arm, base).
RATIOS = (
    ("ratio", "daemon", "raw"),
    ("vs_engine", "daemon", "engine"),
    ("process_pin_vs_scoped", "daemon_process_pin", "daemon"),
    ("http_vs_zeromq", "http", "daemon"),
    ("http_stream_vs_zeromq", "http_stream", "daemon"),
)


def batched_rows(samples: dict[tuple[str, int], list[float]], setup: Setup) -> list[dict[str, Any]]:
    """One row per finished batch size: each arm's median tok/s and spread; daemon / raw, daemon /
    engine (and process pin / scoped, HTTP / ZeroMQ) as ratios of medians with their spreads
    (``ratio_spread``)."""
    rows = []
    for b in setup.finished(samples):
        row: dict[str, Any] = {"batch": b}
        arms = setup.batched_arms(b)
        for arm in arms:
            row[f"{arm}_tok_s"] = statistics.median(samples[(arm, b)])
            row[f"{arm}_spread"] = spread(samples[(arm, b)])
        for key, arm, base in RATIOS:
            if arm in arms and base in arms:
                row[key] = row[f"{arm}_tok_s"] / row[f"{base}_tok_s"]
                row[f"{key}_spread"] = ratio_spread(samples[(arm, b)], samples[(base, b)])
        row["reference_tok_s"] = setup.reference(b)
        row["kv_bytes_per_step"] = b * setup.kv_bytes_per_token * setup.context
        rows.append(row)
    return rows


def _with_spread(value: float | None, lohi: list[float] | None, fmt: str) -> str:
    """``median (min-max)``, or ``-`` for an arm not run at that B."""
    if value is None or lohi is None:
        return "-"
    lo, hi = lohi
    return f"{value:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"


#: The HTTP arms' names in the batched table.
HTTP_LABELS = {"http": "daemon via HTTP", "http_stream": "daemon via HTTP, streamed"}


def batched_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The batched table: every arm's median tok/s with its spread, the ratios with theirs and, with a
    bandwidth, the physical limit, the KV bytes each step reads and each arm's fraction of the limit."""
    pinned = "daemon_process_pin_tok_s" in rows[0]
    http = [
        (arm, key)
        for arm, key in (("http", "http_vs_zeromq"), ("http_stream", "http_stream_vs_zeromq"))
        if f"{arm}_tok_s" in rows[0]
    ]
    roof = rows[0].get("reference_tok_s") is not None
    cols = ["B", "raw BatchGenerator tok/s", "engine alone tok/s", "daemon tok/s", "daemon / raw", "daemon / engine"]
    if pinned:
        cols += ["daemon, process pin tok/s", "process pin / scoped"]
    for arm, _ in http:
        cols += [f"{HTTP_LABELS[arm]} tok/s", f"{HTTP_LABELS[arm]} / ZeroMQ"]
    if roof:
        cols += ["physical limit tok/s", "KV read per step (MB)", "raw / engine / daemon of the limit"]

    def line(r: dict[str, Any]) -> str:
        cells = [str(r["batch"])]
        cells += [_with_spread(r.get(f"{a}_tok_s"), r.get(f"{a}_spread"), ".1f") for a in ("raw", "engine", "daemon")]
        cells += [_with_spread(r.get(k), r.get(f"{k}_spread"), ".3f") for k in ("ratio", "vs_engine")]
        if pinned:
            cells.append(_with_spread(r["daemon_process_pin_tok_s"], r["daemon_process_pin_spread"], ".1f"))
            cells.append(_with_spread(r["process_pin_vs_scoped"], r["process_pin_vs_scoped_spread"], ".3f"))
        for arm, key in http:
            cells.append(_with_spread(r[f"{arm}_tok_s"], r[f"{arm}_spread"], ".1f"))
            cells.append(_with_spread(r[key], r[f"{key}_spread"], ".3f"))
        if roof:
            limit = r["reference_tok_s"]
            cells += [f"{limit:.0f}", f"{r['kv_bytes_per_step'] / 1e6:.3f}"]
            cells.append(
                " / ".join(
                    f"{r[f'{a}_tok_s'] / limit:.3f}" if f"{a}_tok_s" in r else "-" for a in ("raw", "engine", "daemon")
                )
            )
        return "| " + " | ".join(cells) + " |"

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols), *(line(r) for r in rows)]
    notes = [
        f"tok/s: median of {meta.get('repeats', '?')} repeats (min-max); a ratio: ratio of the medians "
        "(the range its two arms' samples allow)."
    ]
    if roof:
        weights = int(meta["weight_bytes"])
        gb_s = float(meta["bandwidth_gb_s"])
        notes.append(
            f"physical limit: {weights / 1e9:.3f} GB of weights read once per decode step at {gb_s:g} GB/s "
            f"({weights / (gb_s * 1e9) * 1e3:.3f} ms per step), plus each sequence's KV "
            f"({meta['kv_bytes_per_token']} bytes per token of context, mean context {meta['context']} tokens); "
            "B tokens per step."
        )
    if http:
        notes.append(
            "HTTP: the daemon arm's own daemon through its OpenAI-compatible door (`--via http`), the same "
            "token ids as `prompt`, one pooled connection per request in flight; whole answers, and SSE streams "
            "with usage. HTTP / ZeroMQ is that arm over the daemon arm (the client over ipc)."
        )
    if meta.get("raw_max_batch") is not None:
        notes.append(f"raw BatchGenerator measured up to B = {meta['raw_max_batch']} only (`--raw-max-batch`).")
    if not meta.get("complete", True):
        notes.append(f"incomplete run: batch sizes {meta.get('batches_done')} of {meta.get('batches')}.")
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes)


def write_report(
    rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, runs: list[dict[str, Any]] | None = None
) -> str:
    """JSON, a Markdown table and a PNG plot; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    write_whole(out / "daemon_vs_raw.json", json.dumps({"meta": meta, "rows": rows, "runs": runs or []}, indent=2))
    md = batched_markdown(rows, meta)
    write_whole(out / "daemon_vs_raw.md", md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    bs = [r["batch"] for r in rows]
    arms = [
        ("raw", "o-", "raw BatchGenerator"),
        ("engine", "x--", "engine alone (in process)"),
        ("daemon", "s-", "daemon, scoped pins (client over ipc)"),
        ("daemon_process_pin", "^-", "daemon, process-wide pin"),
        ("http", "d-", "daemon via HTTP, whole answers"),
        ("http_stream", "v-", "daemon via HTTP, SSE streams"),
    ]
    for arm, style, label in arms:
        have = [r for r in rows if f"{arm}_tok_s" in r]
        if not have:
            continue
        mid = [r[f"{arm}_tok_s"] for r in have]
        err = [
            [m - r[f"{arm}_spread"][0] for m, r in zip(mid, have)],
            [r[f"{arm}_spread"][1] - m for m, r in zip(mid, have)],
        ]
        ax.errorbar([r["batch"] for r in have], mid, yerr=err, fmt=style, capsize=3, label=label)
    if rows[0].get("reference_tok_s") is not None:
        ax.plot(bs, [r["reference_tok_s"] for r in rows], ":", color="grey", label="physical limit")
        ax.set_yscale("log")
    ax.set_xlabel("concurrent sequences (B)")
    ax.set_ylabel("generated tokens / s (median, whiskers min-max)")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{meta['model']} on {meta['device']}")
    ax.legend()
    ax.grid(alpha=0.3)
    save_png(fig, out / "daemon_vs_raw.png")
    return md


def drafter_args(spec: str) -> list[str]:
    """Daemon flags for one drafter spec: ``mtp:DIR|demo`` is an MTP head, anything else ``--draft``."""
    return ["--mtp", spec.split(":", 1)[1]] if spec.startswith("mtp:") else ["--draft", spec]


BURST_COUNTS = ("rounds", "drafted_tokens", "accepted_tokens", "emitted_tokens")


def _burst_counts(client: Any) -> dict[str, int]:
    b = client.stats()["engine"].get("bursts", {})
    return {k: int(b.get(k, 0)) for k in BURST_COUNTS}


def b1_status(verdict: dict[str, Any], rounds: int) -> str:
    """``bursts`` only when the verdict let bursts run and at least one round did; else why not."""
    if verdict.get("level") is None:
        return "declined: verdict"
    if not rounds:
        return "declined: no burst round ran"
    return "bursts"


def b1_rows(
    samples: dict[tuple[str, int], list[float]],
    counts: dict[str, dict[str, int]],
    verdicts: dict[str, dict[str, Any]],
    reference: float | None = None,
) -> list[dict[str, Any]]:
    """B = 1 through the daemon: classic (no drafter) vs each drafter's bursts, same prompts and repeats.

    ``vs_classic`` is the ratio of medians and ``vs_classic_spread`` its range (``ratio_spread``).
    ``speedup`` is that ratio only for an arm whose bursts ran; a declined arm (declined verdict,
    or no round ran) has ``speedup`` None, and ``alike`` says whether 1.0 is within its spread
    (an arm that decoded classically must read 1.00, else the arms were not measured alike)."""
    base = samples[("daemon", 1)]
    classic = statistics.median(base)

    def of_limit(tok_s: float) -> float | None:
        return None if not reference else tok_s / reference

    rows: list[dict[str, Any]] = [
        {
            "drafter": "classic (no drafter)",
            "tok_s": classic,
            "tok_s_spread": spread(base),
            "vs_classic": 1.0,
            "vs_classic_spread": ratio_spread(base, base),
            "speedup": None,
            "status": "classic",
            "alike": None,
            "rounds": None,
            "acceptance": None,
            "tokens_per_round": None,
            "verdict": "-",
            "of_limit": of_limit(classic),
        }
    ]
    for arm, c in counts.items():
        xs = samples[(arm, 1)]
        rate = statistics.median(xs)
        v = verdicts.get(arm, {})
        status = b1_status(v, c["rounds"])
        lo, hi = ratio_spread(xs, base)
        rows.append(
            {
                "drafter": arm.removeprefix("bursts:"),
                "tok_s": rate,
                "tok_s_spread": spread(xs),
                "vs_classic": rate / classic,
                "vs_classic_spread": [lo, hi],
                "speedup": rate / classic if status == "bursts" else None,
                "status": status,
                "alike": None if status == "bursts" else lo <= 1.0 <= hi,
                "rounds": c["rounds"],
                "acceptance": c["accepted_tokens"] / c["drafted_tokens"] if c["drafted_tokens"] else None,
                "tokens_per_round": c["emitted_tokens"] / c["rounds"] if c["rounds"] else None,
                "verdict": f"{v.get('level') or 'declined'}{'' if v.get('exact', False) else ' (inexact)'}",
                "of_limit": of_limit(rate),
            }
        )
    return rows


def _vs_classic_cell(r: dict[str, Any]) -> str:
    """A speedup only where bursts ran; a declined arm's ratio is labelled as such."""
    if r["status"] == "classic":
        return "1.000 (reference)"
    if r["status"] == "bursts":
        return f"{r['speedup']:.3f}x"
    return f"{r['status']} (ratio {r['vs_classic']:.3f})"


def b1_markdown(rows: list[dict[str, Any]], reference_line: str | None = None) -> str:
    """The B = 1 table: every arm's median and spread, its ratio to classic and that ratio's spread."""

    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    roof = any(r["of_limit"] is not None for r in rows)
    head = "| drafter | tok/s | spread (min-max) | vs classic | spread of the ratio | rounds | acceptance | tokens/round | verdict |"
    rule = "|---|---|---|---|---|---|---|---|---|"
    if roof:
        head += " tok/s / physical limit |"
        rule += "---|"
    lines = [head, rule]
    for r in rows:
        lo, hi = r["tok_s_spread"]
        rlo, rhi = r["vs_classic_spread"]
        line = (
            f"| {r['drafter']} | {r['tok_s']:.1f} | {lo:.1f}-{hi:.1f} | {_vs_classic_cell(r)} | {rlo:.3f}-{rhi:.3f} "
            f"| {cell(r['rounds'], 'd')} | {cell(r['acceptance'], '.3f')} | {cell(r['tokens_per_round'], '.2f')} "
            f"| {r['verdict']} |"
        )
        if roof:
            line += f" {cell(r['of_limit'], '.3f')} |"
        lines.append(line)
    notes = [
        f"warning: {r['drafter']} decoded classically ({r['status']}) yet reads {r['vs_classic']:.3f} "
        f"({rlo:.3f}-{rhi:.3f}) of classic: these arms were not measured alike"
        for r in rows
        for rlo, rhi in [r["vs_classic_spread"]]
        if r["alike"] is False
    ]
    if reference_line:
        notes.append(f"{reference_line} (classic decode; a burst round reads the weights once for several tokens)")
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes)


def write_b1(
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    out: Path,
    reference_line: str | None = None,
    runs: list[dict[str, Any]] | None = None,
) -> str:
    """B = 1 classic vs bursts: JSON, Markdown, PNG; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    write_whole(
        out / "b1_bursts.json",
        json.dumps({"meta": meta, "reference": reference_line, "rows": rows, "runs": runs or []}, indent=2),
    )
    md = b1_markdown(rows, reference_line)
    write_whole(out / "b1_bursts.md", md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 0.6 * len(rows) + 1.5))
    tok_s = [r["tok_s"] for r in rows]
    errors = [
        [t - r["tok_s_spread"][0] for t, r in zip(tok_s, rows)],
        [r["tok_s_spread"][1] - t for t, r in zip(tok_s, rows)],
    ]
    ax.barh([r["drafter"] for r in rows], tok_s, xerr=errors, capsize=4)
    ax.set(
        xlabel="generated tokens / s at B = 1 (daemon, client over ipc; bars: median, whiskers: min-max)",
        title=f"{meta['model']} on {meta['device']}",
    )
    ax.invert_yaxis()
    save_png(fig, out / "b1_bursts.png")
    return md


def write_tables(
    samples: dict[tuple[str, int], list[float]],
    setup: Setup,
    meta: dict[str, Any],
    out: Path,
    counts: dict[str, dict[str, int]] | None = None,
    verdicts: dict[str, dict[str, Any]] | None = None,
    runs: list[dict[str, Any]] | None = None,
) -> str:
    """Write every table with the batch sizes finished so far and return their Markdown.

    Called after each batch size, so a run that an outer timeout stops keeps the rows it finished
    (``meta['complete']`` says whether every batch size is in). The B = 1 table needs the burst
    ``counts`` of its arms, taken when B = 1 finished."""
    done = setup.finished(samples)
    meta = {**meta, "batches": list(setup.batches), "batches_done": done, "complete": done == list(setup.batches)}
    rows = batched_rows(samples, setup)
    if not rows:
        return ""
    md = write_report(rows, meta, out, runs)
    if 1 in done and setup.b1_arms and counts is not None:
        b1 = b1_rows(samples, counts, verdicts or {}, setup.reference(1))
        b1_runs = [r for r in runs or [] if r["batch"] == 1]
        md += "\n" + write_b1(b1, meta, out, setup.reference_line(1), b1_runs)
    return md


def _memory_gib() -> dict[str, float]:
    """MLX's active, cached and peak memory in this process, GiB."""
    import mlx.core as mx

    gib = 2.0**30
    return {
        "active": mx.get_active_memory() / gib,
        "cache": mx.get_cache_memory() / gib,
        "peak": mx.get_peak_memory() / gib,
    }


def _idle(engine: dict[str, Any]) -> bool:
    """Whether a daemon's engine is doing nothing: started, no probe queued or running, no sequence."""
    verdicts = engine.get("verdicts", {})
    return bool(engine) and not engine.get("active_sequences") and all("level" in v for v in verdicts.values())


def wait_idle(clients: dict[str, Any], poll_s: float = 0.05) -> None:
    """Until every daemon is idle (``_idle``), the ones that never probe included. A daemon's start-up
    probe runs whenever it has nothing to serve, so a daemon still probing would share the GPU with the
    arm being timed."""
    for c in clients.values():
        while not _idle(c.stats()["engine"]):
            time.sleep(poll_s)  # polling a daemon that offers no completion event


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    """An outer timeout's SIGTERM unwinds like Ctrl-C would: the daemons are stopped, and the tables
    written after each finished batch size stay."""
    raise SystemExit(128 + signum)


def main(args: argparse.Namespace) -> int:
    if threading.current_thread() is not threading.main_thread():
        return _main(args)
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from clients.sync import Client
    from scheduler.spawn import DaemonProcess
    from workers import fastpath
    from workers.engine import Engine
    from workers.models import load

    if getattr(args, "prefix_scenario", False):
        return run_prefix(args)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    via_http = getattr(args, "via", "zeromq") == "http"
    if via_http and importlib.util.find_spec("httpx") is None:
        from scheduler.cli import CommandError

        # Said before the model loads: the HTTP arms' client is not one of the daemon's dependencies.
        raise CommandError("--via http needs httpx, the HTTP arms' client: pip install httpx")
    progress(f"bench: loading {args.model}")
    # One model for the in-process arms: the raw arm runs it with the project's patches lifted.
    loaded = load(args.model)
    path = Path(loaded.info.path)
    model = loaded.model
    eos = list(loaded.info.eos_token_ids)
    max_batch = max(32, *batches)  # the daemons' and the engine's, so that no B queues
    engine = Engine(
        model,
        eos_token_ids=loaded.info.eos_token_ids,
        vocab_size=loaded.info.vocab_size,
        max_batch=max_batch,
    )
    weight_bytes = sum(v.nbytes for _, v in cast(list[tuple[str, Any]], tree_flatten(model.parameters())))
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    tmp = Path(tempfile.mkdtemp(prefix="mlx-batchd-bench-"))
    drafters = [d for d in (args.drafters or "").split(",") if d]
    samples: dict[tuple[str, int], list[float]] = {}
    runs: list[dict[str, Any]] = []
    poisson: dict[str, Any] | None = None
    cap = ["--max-tokens-cap", str(args.tokens), "--max-batch", str(max_batch)]
    http_url = f"http://127.0.0.1:{free_port()}" if via_http else None
    # The HTTP arms measure the daemon arm's own daemon: one process, one engine, two doors.
    http_flags = ["--http", http_url.removeprefix("http://")] if http_url else []
    daemons: dict[str, list[str]] = {"daemon": [*cap, *http_flags]}
    if args.process_pin:
        daemons["daemon_process_pin"] = [
            *cap,
            "--probe-k",
            "4",
            "--pin-level",
            args.process_pin,
            "--pin-scope",
            "process",
        ]
    b1_arms = [f"bursts:{d}" for d in drafters]  # measured at B = 1 only
    for arm, d in zip(b1_arms, drafters):
        daemons[arm] = [*cap, *drafter_args(d)]
    gb_per_s = getattr(args, "bandwidth_gbs", None) or None
    setup = Setup(
        batches=tuple(batches),
        arms=(
            "raw",
            "engine",
            "daemon",
            *(("daemon_process_pin",) if args.process_pin else ()),
            *(HTTP_ARMS if via_http else ()),
        ),
        b1_arms=tuple(b1_arms),
        repeats=args.repeats,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=loaded.info.kv_bytes_per_token,
        context=args.prompt_tokens + args.tokens // 2,  # the mean context over a sequence's decode
        gb_per_s=gb_per_s,
        raw_max_batch=getattr(args, "raw_max_batch", None),
    )
    meta: dict[str, Any] = {
        "raw_max_batch": setup.raw_max_batch,
        "model": args.model,
        "model_path": str(path),
        "device": str(mx.default_device()),
        "mlx": str(getattr(mx, "__version__", "unknown")),
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "context": setup.context,
        "drafters": drafters,
        "process_pin": args.process_pin,
        "via": "http" if via_http else "zeromq",
        "http_url": http_url,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": loaded.info.kv_bytes_per_token,
        "bandwidth_gb_s": gb_per_s,
        "fastpath": fastpath.active().name,
    }
    out = Path(args.out)
    counts: dict[str, dict[str, int]] | None = None
    verdicts: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        progress(f"bench: starting {len(daemons)} daemon(s): {', '.join(daemons)}")
        procs = {
            name: stack.enter_context(DaemonProcess(args.model, f"ipc://{tmp / f'{i}.sock'}", *extra))
            for i, (name, extra) in enumerate(daemons.items())
        }
        clients = {name: stack.enter_context(Client(proc.address, timeout=3600)) for name, proc in procs.items()}
        http = stack.enter_context(open_http(http_url)) if http_url else None
        model_id = served_model(http) if http else ""
        progress("bench: waiting for the daemons' start-up probes")
        wait_idle(clients)  # every start-up probe has finished before anything is timed
        probe_seconds: dict[str, float] = {}
        for name, c in clients.items():
            for pairing, v in c.stats()["engine"]["verdicts"].items():
                if "probe_seconds" in v:
                    probe_seconds[f"{name} ({pairing})"] = v["probe_seconds"]
                verdicts[name] = v
        meta["probe_seconds"] = probe_seconds

        def run(arm: str, prompts: list[list[int]], tokens: int) -> tuple[int, float]:
            if arm == "raw":
                return run_raw(model, eos, prompts, tokens)
            if arm == "engine":
                return run_engine(engine, prompts, tokens)
            if arm in HTTP_ARMS:
                return run_http(http, model_id, prompts, tokens, HTTP_ARMS[arm])
            return run_daemon(clients[arm], prompts, tokens)

        def counters(arm: str) -> dict[str, float] | None:
            """The arm's engine step counters (``None`` for raw: mlx-lm keeps its own)."""
            if arm == "raw":
                return None
            if arm == "engine":
                return step_counters(asdict(engine.counters))
            return step_counters(clients["daemon" if arm in HTTP_ARMS else arm].stats()["engine"])

        progress("bench: warming every arm up (untimed)")
        warm = _prompts(2, args.prompt_tokens, vocab, seed=99)
        for arm in setup.arms:
            run(arm, warm, min(8, args.tokens))  # the daemons refuse more than --tokens
        if 1 in batches:
            # The measured shape, once, in every B = 1 arm (see the module's docstring).
            shape = _prompts(1, args.prompt_tokens, vocab, seed=98)
            for arm in setup.arms_at(1):
                wait_idle(clients)
                run(arm, shape, args.tokens)
                mx.clear_cache()
        before = {name: _burst_counts(clients[name]) for name in b1_arms}
        total = args.repeats * sum(len(setup.arms_at(b)) for b in batches)
        done = 0
        for b in batches:
            for rep in range(args.repeats):
                prompts = _prompts(b, args.prompt_tokens, vocab, seed=1000 * b + rep)
                for position, arm in enumerate(rotated(setup.arms_at(b), rep)):
                    wait_idle(clients)
                    before_steps = counters(arm)
                    n, wall = run(arm, prompts, args.tokens)
                    after_steps = counters(arm)
                    samples.setdefault((arm, b), []).append(n / wall)
                    runs.append(
                        {
                            "batch": b,
                            "repeat": rep,
                            "position": position,
                            "arm": arm,
                            "tokens": n,
                            "seconds": wall,
                            # This process's MLX memory (raw and engine arms run here), for a run
                            # that ends out of memory on a shared GPU.
                            "bench_process_gib": _memory_gib(),
                            # How the engine spent the run (steps, decode steps, their seconds): a
                            # daemon slower than the engine alone shows here as more or slower steps.
                            "engine_steps": None
                            if before_steps is None or after_steps is None
                            else {k: after_steps[k] - before_steps[k] for k in STEP_COUNTERS},
                        }
                    )
                    mx.clear_cache()  # MLX keeps freed buffers; on one GPU the daemons need that memory
                    done += 1
                    progress(
                        f"bench [{done}/{total}] B = {b}, repeat {rep + 1}/{args.repeats}, {arm}: "
                        f"{n} tokens in {wall:.3f} s = {n / wall:.1f} tok/s"
                    )
            if b == 1 and b1_arms:
                counts = {
                    name: {k: v - before[name][k] for k, v in _burst_counts(clients[name]).items()} for name in b1_arms
                }
            write_tables(samples, setup, meta, out, counts, verdicts, runs)
            progress(f"bench: B = {b} done, tables for B = {setup.finished(samples)} in {out}")
        if args.poisson_rate > 0:
            # The production shape: the first drafter's daemon (bursts whenever one request is alone).
            target = b1_arms[0] if b1_arms else "daemon"
            progress(f"bench: {args.poisson_requests} Poisson arrivals at {args.poisson_rate:g}/s on '{target}'")
            wait_idle(clients)
            poisson = run_poisson(procs[target].address, args.poisson_rate, args.poisson_requests, vocab, args.tokens)
            poisson["daemon"] = target
            write_poisson(poisson, meta, out)
    # Every daemon got SIGTERM when the stack closed; anything but 0 is a shutdown bug worth seeing.
    exit_codes = {name: proc.proc.returncode for name, proc in procs.items()}
    for name, code in exit_codes.items():
        if code != 0:
            print(f"warning: the '{name}' daemon exited with {code} after SIGTERM", file=sys.stderr)
    meta["daemon_exit_codes"] = exit_codes
    print(write_tables(samples, setup, meta, out, counts, verdicts, runs))
    if poisson is not None:
        print(f"Poisson arrivals on the '{poisson['daemon']}' daemon:")
        print(write_poisson(poisson, meta, out))
    if probe_seconds:
        print("probe time: " + ", ".join(f"{k}: {v:.2f}s" for k, v in probe_seconds.items()))
    print(f"results in {out.resolve()}", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- prefix cache

#: Tokens each TTFT request of the prefix scenario generates; only the first is timed.
TTFT_TOKENS = 4
#: The prefix scenario's daemons: with ``--prefix-cache-mb``, and the same daemon without it.
PREFIX_ARMS = ("no_cache", "cache")
#: The prefix scenario's parts (``--prefix-parts``), in the order they run.
PREFIX_PARTS = ("ttft", "chat", "throughput")
#: Issue 17's targets: cold / warm TTFT at least, chat prefill computed / cache-less at most,
#: throughput with the cache on and no hit / without the cache at least.
PREFIX_TARGETS = {"ttft_ratio": 5.0, "chat_fraction": 0.15, "throughput_ratio": 0.98}


@dataclass(frozen=True)
class PrefixPlan:
    """The prefix scenario's shapes (``bench --prefix-scenario`` flags)."""

    prefix: int
    suffix: int
    warm: int
    turns: int
    system: int
    user: int
    answer: int
    batch: int
    prompt_tokens: int
    tokens: int
    repeats: int
    parts: tuple[str, ...] = PREFIX_PARTS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PrefixPlan:
        chosen = set(getattr(args, "prefix_parts", ",".join(PREFIX_PARTS)).split(","))
        return cls(
            prefix=args.prefix_tokens,
            suffix=args.suffix_tokens,
            warm=args.warm_requests,
            turns=args.chat_turns,
            system=args.chat_system_tokens,
            user=args.chat_user_tokens,
            answer=args.chat_answer_tokens,
            batch=args.prefix_batch,
            prompt_tokens=args.prompt_tokens,
            tokens=args.tokens,
            repeats=args.repeats,
            parts=tuple(p for p in PREFIX_PARTS if p in chosen),
        )

    @property
    def max_tokens_cap(self) -> int:
        """The daemons' ``--max-tokens-cap``: the largest budget any part asks for."""
        return max(
            TTFT_TOKENS if "ttft" in self.parts else 1,
            self.answer if "chat" in self.parts else 1,
            self.tokens if "throughput" in self.parts else 1,
        )

    def too_long(self, context: int) -> str | None:
        """Why a part does not fit the model's context (the daemon refuses prompt + max_tokens past
        it), with the largest setting that does; ``None`` when every part fits."""
        ttft = self.prefix + self.suffix + TTFT_TOKENS
        if "ttft" in self.parts and ttft > context:
            room = context - self.suffix - TTFT_TOKENS
            return (
                f"--prefix-tokens {self.prefix} + --suffix-tokens {self.suffix} + {TTFT_TOKENS} generated tokens "
                f"exceed the model's context ({context}); use --prefix-tokens {room} or less"
            )
        chat = self.system + self.turns * (self.user + self.answer)
        if "chat" in self.parts and chat > context:
            return (
                f"a {self.turns}-turn chat ({self.system} + {self.turns} x ({self.user} + {self.answer}) = {chat} "
                f"tokens) exceeds the model's context ({context}); shorten --chat-* or use fewer --chat-turns"
            )
        if "throughput" in self.parts and self.prompt_tokens + self.tokens > context:
            return f"--prompt-tokens + --tokens exceed the model's context ({context})"
        return None

    def steps(self) -> int:
        """Timed requests and runs, for the progress lines: TTFT requests, chat conversations (one per
        daemon), throughput runs (one per daemon)."""
        per_repeat = {"ttft": 1 + self.warm, "chat": 2, "throughput": 2}
        return self.repeats * sum(per_repeat[p] for p in self.parts)


def _random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, min(vocab, 256)) for _ in range(n)]


def prefix_counters(client: Any) -> dict[str, int]:
    """What the prefix scenario reads from a daemon's ``stats``: the prompt tokens every tenant was
    served (every prompt token, cached or not) and the prefix cache's counters (0 without a cache)."""
    stats = client.stats()
    cache = stats["engine"].get("prefix_cache") or {}
    served = sum(int(t.get("served_prompt_tokens", 0)) for t in (stats.get("tenants") or {}).values())
    counts = {k: int(cache.get(k, 0)) for k in ("queries", "hits", "hit_tokens", "lookup_tokens", "evictions")}
    return {"served_prompt_tokens": served, **counts}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def timed_request(client: Any, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy request: the client's time to its first token (submit to the first token
    event), the daemon's own ``ttft_s``, the tokens, and what the request moved in ``stats``."""
    from clients.events import EndEvent, TokenEvent

    before = prefix_counters(client)
    out: list[int] = []
    first: float | None = None
    end: EndEvent | None = None
    sent = time.perf_counter()
    for ev in client.stream(tokens=tokens, max_tokens=max_tokens):
        if isinstance(ev, TokenEvent):
            if ev.tokens and first is None:
                first = time.perf_counter() - sent
            out.extend(ev.tokens)
        else:
            end = ev
    seconds = time.perf_counter() - sent
    if end is None or end.error is not None:
        raise RuntimeError(f"a prefix scenario request failed: {end.error if end else 'no end event'}")
    moved = _delta(prefix_counters(client), before)
    return {
        "prompt_tokens": len(tokens),
        "ttft_s": first if first is not None else seconds,
        "daemon_ttft_s": end.timings.get("ttft_s"),
        "seconds": seconds,
        "tokens": out,
        "hit_tokens": moved["hit_tokens"],
        "computed_tokens": moved["served_prompt_tokens"] - moved["hit_tokens"],
    }


def run_chat(client: Any, system: list[int], users: list[list[int]], answer_tokens: int) -> dict[str, Any]:
    """A chat replayed as a chat client sends it: every turn's prompt is the whole conversation so far
    (the first message, each earlier user message and the model's answer to it) and a new user
    message. Per turn: prompt tokens, tokens taken from the cache and prefilled (from ``stats``)."""
    convo = list(system)
    turns = []
    tic = time.perf_counter()
    for i, user in enumerate(users):
        prompt = convo + user
        r = timed_request(client, prompt, answer_tokens)
        turns.append({"turn": i + 1, **{k: v for k, v in r.items() if k != "tokens"}, "answer": r["tokens"]})
        convo = prompt + r["tokens"]
    return {
        "seconds": time.perf_counter() - tic,
        "turns": turns,
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "hit_tokens": sum(t["hit_tokens"] for t in turns),
        "computed_tokens": sum(t["computed_tokens"] for t in turns),
    }


def _ratio_cell(value: float, lohi: list[float], suffix: str = "") -> str:
    return f"{value:.3f}{suffix} ({lohi[0]:.3f}-{lohi[1]:.3f}{suffix})"


def prefix_ttft_rows(requests: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Cold (the first request of each new prefix) and warm (the later ones, new suffixes) TTFT:
    medians, spreads, their ratio with the range the samples allow, hit tokens."""
    cold = [r["ttft_s"] for r in requests if r["kind"] == "cold"]
    warm = [r["ttft_s"] for r in requests if r["kind"] == "warm"]
    if not cold or not warm:
        return None
    ratio = statistics.median(cold) / statistics.median(warm)
    return {
        "cold_ms": statistics.median(cold) * 1e3,
        "cold_spread_ms": [x * 1e3 for x in spread(cold)],
        "cold_requests": len(cold),
        "warm_ms": statistics.median(warm) * 1e3,
        "warm_spread_ms": [x * 1e3 for x in spread(warm)],
        "warm_requests": len(warm),
        "cold_over_warm": ratio,
        "cold_over_warm_spread": ratio_spread(cold, warm),
        "cold_hit_tokens": [r["hit_tokens"] for r in requests if r["kind"] == "cold"],
        "warm_hit_tokens": [r["hit_tokens"] for r in requests if r["kind"] == "warm"],
        "cold_daemon_ms": statistics.median(r["daemon_ttft_s"] or 0.0 for r in requests if r["kind"] == "cold") * 1e3,
        "warm_daemon_ms": statistics.median(r["daemon_ttft_s"] or 0.0 for r in requests if r["kind"] == "warm") * 1e3,
    }


def prefix_chat_rows(chats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per conversation: prompt tokens sent (every one a cache-less daemon prefills), what the
    cache-less daemon prefilled and what the cache daemon prefilled, the fraction, and whether the
    two daemons answered alike (else the two conversations differ after the first differing answer)."""
    rows = []
    for i, c in enumerate(chats):
        with_cache, without = c["cache"], c["no_cache"]
        same = [t["answer"] for t in with_cache["turns"]] == [t["answer"] for t in without["turns"]]
        rows.append(
            {
                "conversation": i + 1,
                "turns": len(with_cache["turns"]),
                "prompt_tokens": with_cache["prompt_tokens"],
                "no_cache_computed": without["computed_tokens"],
                "cache_computed": with_cache["computed_tokens"],
                "hit_tokens": with_cache["hit_tokens"],
                "fraction": with_cache["computed_tokens"] / with_cache["prompt_tokens"],
                "answers_identical": same,
                "cache_seconds": with_cache["seconds"],
                "no_cache_seconds": without["seconds"],
            }
        )
    return rows


def prefix_throughput_row(samples: dict[str, list[float]], batch: int, hits: dict[str, int]) -> dict[str, Any]:
    """Cache on (no hit) over no cache at ``batch``: medians, spreads, the ratio and its range."""
    on, off = samples["cache"], samples["no_cache"]
    return {
        "batch": batch,
        "no_cache_tok_s": statistics.median(off),
        "no_cache_spread": spread(off),
        "cache_tok_s": statistics.median(on),
        "cache_spread": spread(on),
        "ratio": statistics.median(on) / statistics.median(off),
        "ratio_spread": ratio_spread(on, off),
        **hits,
    }


def _target(met: bool) -> str:
    return "met" if met else "not met"


def prefix_markdown(result: dict[str, Any]) -> str:
    """The prefix scenario's tables, for the parts finished so far."""
    meta = result["meta"]
    parts = []
    cache = meta.get("prefix_cache") or {}
    if not cache.get("serving", True):
        parts.append(
            f"warning: the cache daemon's prefix cache is not serving ({(cache.get('verdict') or {}).get('reason')}): "
            "every figure below is of a daemon without reuse"
        )
    t = result.get("ttft")
    if t:
        target = PREFIX_TARGETS["ttft_ratio"]
        parts.append(
            "\n".join(
                [
                    f"TTFT, a {meta['prefix_tokens']}-token shared prefix + {meta['suffix_tokens']}-token suffixes "
                    f"(client side, submit to first token; {t['cold_requests']} prefixes, {meta['warm_requests']} warm "
                    "requests each):",
                    "",
                    "| request | requests | TTFT median (ms) | min-max (ms) | daemon's ttft_s median (ms) | tokens from the cache |",
                    "|---|---|---|---|---|---|",
                    f"| cold (first of a new prefix) | {t['cold_requests']} | {t['cold_ms']:.1f} | "
                    f"{t['cold_spread_ms'][0]:.1f}-{t['cold_spread_ms'][1]:.1f} | {t['cold_daemon_ms']:.1f} | "
                    f"{min(t['cold_hit_tokens'])}-{max(t['cold_hit_tokens'])} |",
                    f"| warm (same prefix, new suffix) | {t['warm_requests']} | {t['warm_ms']:.1f} | "
                    f"{t['warm_spread_ms'][0]:.1f}-{t['warm_spread_ms'][1]:.1f} | {t['warm_daemon_ms']:.1f} | "
                    f"{min(t['warm_hit_tokens'])}-{max(t['warm_hit_tokens'])} |",
                    f"| cold / warm | | {t['cold_over_warm']:.2f}x | "
                    f"{t['cold_over_warm_spread'][0]:.2f}-{t['cold_over_warm_spread'][1]:.2f}x | | |",
                    "",
                    f"cold / warm: ratio of the medians (the range the samples allow); target >= {target:g}x: "
                    f"{_target(t['cold_over_warm'] >= target)}.",
                ]
            )
        )
    chat = result.get("chat_rows")
    if chat:
        target = PREFIX_TARGETS["chat_fraction"]
        lines = [
            f"A {meta['chat_turns']}-turn chat replayed through the client ({meta['chat_system_tokens']}-token first "
            f"message, {meta['chat_user_tokens']}-token user messages, answers of up to {meta['chat_answer_tokens']} "
            "greedy tokens; every turn sends the whole conversation), prefill tokens from each daemon's `stats`:",
            "",
            "| conversation | prompt tokens sent | prefilled, no cache | prefilled, cache | from the cache | "
            "prefilled / cache-less | answers identical | seconds, cache / no cache |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in chat:
            lines.append(
                f"| {r['conversation']} | {r['prompt_tokens']} | {r['no_cache_computed']} | {r['cache_computed']} | "
                f"{r['hit_tokens']} | {r['fraction'] * 100:.1f} % | {'yes' if r['answers_identical'] else 'no'} | "
                f"{r['cache_seconds']:.2f} / {r['no_cache_seconds']:.2f} |"
            )
        fractions = [r["fraction"] for r in chat]
        mid = statistics.median(fractions)
        lines += [
            "",
            f"prefilled / cache-less: median {mid * 100:.1f} % ({min(fractions) * 100:.1f}-{max(fractions) * 100:.1f} %) "
            f"over {len(chat)} conversation(s); target <= {target * 100:g} %: {_target(max(fractions) <= target)}.",
        ]
        parts.append("\n".join(lines))
    row = result.get("throughput")
    if row:
        target = PREFIX_TARGETS["throughput_ratio"]
        lo, hi = row["ratio_spread"]
        parts.append(
            "\n".join(
                [
                    f"Throughput at B = {row['batch']}, distinct random {meta['prompt_tokens']}-token prompts, "
                    f"{meta['tokens']} tokens each (tok/s: median of {meta['repeats']} (min-max)):",
                    "",
                    "| B | no cache tok/s | cache on tok/s | cache on / no cache | cache hits (tokens) during the runs |",
                    "|---|---|---|---|---|",
                    f"| {row['batch']} | {_with_spread(row['no_cache_tok_s'], row['no_cache_spread'], '.1f')} | "
                    f"{_with_spread(row['cache_tok_s'], row['cache_spread'], '.1f')} | "
                    f"{_ratio_cell(row['ratio'], row['ratio_spread'])} | {row['hits']} ({row['hit_tokens']} of "
                    f"{row['lookup_tokens']} looked up) |",
                    "",
                    f"cache on / no cache: target >= {target:g}: median {_target(row['ratio'] >= target)}; the range "
                    f"{lo:.3f}-{hi:.3f} {'lies above' if lo >= target else 'lies below' if hi < target else 'includes'} it.",
                ]
            )
        )
    if not meta.get("complete", False):
        parts.append(f"incomplete run: parts done {meta.get('parts_done')}.")
    return "\n\n".join(parts) + "\n"


def write_prefix(result: dict[str, Any], out: Path) -> str:
    """The prefix scenario's JSON, Markdown and PNG for the parts finished so far; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    write_whole(out / "prefix_cache.json", json.dumps(result, indent=2))
    md = prefix_markdown(result)
    write_whole(out / "prefix_cache.md", md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ttft, chats, row = result.get("ttft"), result.get("chats") or [], result.get("throughput")
    if ttft:
        mids = [ttft["cold_ms"], ttft["warm_ms"]]
        lohi = [ttft["cold_spread_ms"], ttft["warm_spread_ms"]]
        axes[0].bar(
            ["cold", "warm"],
            mids,
            yerr=[[m - s[0] for m, s in zip(mids, lohi)], [s[1] - m for m, s in zip(mids, lohi)]],
            capsize=4,
        )
        axes[0].set(ylabel="TTFT ms (median, whiskers min-max)", title=f"cold / warm = {ttft['cold_over_warm']:.1f}x")
    if chats:
        turns = chats[0]["cache"]["turns"]
        xs = [t["turn"] for t in turns]
        axes[1].bar(
            xs, [t["prompt_tokens"] for t in turns], label="prompt tokens (cache-less prefill)", color="lightgrey"
        )
        axes[1].bar(xs, [t["computed_tokens"] for t in turns], label="prefilled with the cache")
        axes[1].set(xlabel="turn (first conversation)", ylabel="tokens", title="multi-turn chat", xticks=xs)
        axes[1].legend(fontsize=8)
    if row:
        mids = [row["no_cache_tok_s"], row["cache_tok_s"]]
        lohi = [row["no_cache_spread"], row["cache_spread"]]
        axes[2].bar(
            ["no cache", "cache on, 0 % hits"],
            mids,
            yerr=[[m - s[0] for m, s in zip(mids, lohi)], [s[1] - m for m, s in zip(mids, lohi)]],
            capsize=4,
        )
        axes[2].set(ylabel="generated tok/s (median, whiskers min-max)", title=f"B = {row['batch']}")
    fig.suptitle(f"prefix cache: {result['meta']['model']} on {result['meta']['device']}")
    save_png(fig, out / "prefix_cache.png")
    return md


def run_prefix(args: argparse.Namespace) -> int:
    """``bench --prefix-scenario``: TTFT cold vs warm, a multi-turn chat's prefill, throughput at no hit
    (``--prefix-parts``, each written to the tables as it finishes).

    Two daemons: ``cache`` (``--prefix-cache-mb``) and ``no_cache``, started alike. Every TTFT request
    runs alone on an idle daemon; the first request of each new prefix is the cold one, the next
    ``--warm-requests`` send the same prefix with new suffixes. Each conversation runs on both daemons
    (order rotated), so the cache-less prefill is read from a daemon that has no cache, and the two
    daemons' answers are compared token for token. The throughput arms rotate like the matrix's."""
    import mlx.core as mx

    from clients.sync import Client
    from scheduler.cli import CommandError
    from scheduler.spawn import DaemonProcess

    plan = PrefixPlan.from_args(args)
    out = Path(args.out)
    tmp = Path(tempfile.mkdtemp(prefix="mlx-batchd-bench-"))
    common = ["--max-tokens-cap", str(plan.max_tokens_cap), "--max-batch", str(max(32, plan.batch))]
    daemons = {"no_cache": common, "cache": [*common, "--prefix-cache-mb", f"{args.prefix_cache_mb:g}"]}
    meta: dict[str, Any] = {
        "model": args.model,
        "device": str(mx.default_device()),
        "mlx": str(getattr(mx, "__version__", "unknown")),
        "prefix_cache_mb": args.prefix_cache_mb,
        "prefix_tokens": plan.prefix,
        "suffix_tokens": plan.suffix,
        "ttft_tokens": TTFT_TOKENS,
        "warm_requests": plan.warm,
        "chat_turns": plan.turns,
        "chat_system_tokens": plan.system,
        "chat_user_tokens": plan.user,
        "chat_answer_tokens": plan.answer,
        "batch": plan.batch,
        "prompt_tokens": plan.prompt_tokens,
        "tokens": plan.tokens,
        "repeats": plan.repeats,
        "targets": PREFIX_TARGETS,
        "parts": list(plan.parts),
        "parts_done": [],
        "complete": False,
    }
    result: dict[str, Any] = {"meta": meta}
    done = 0
    total = plan.steps()

    def step(line: str) -> None:
        nonlocal done
        done += 1
        progress(f"bench prefix [{done}/{total}] {line}")

    def finished(part: str) -> None:
        meta["parts_done"].append(part)
        meta["complete"] = tuple(meta["parts_done"]) == plan.parts
        write_prefix(result, out)
        progress(f"bench prefix: {part} done, tables in {out}")

    with contextlib.ExitStack() as stack:
        progress(f"bench prefix: starting 2 daemons: {', '.join(daemons)}")
        procs = {
            name: stack.enter_context(DaemonProcess(args.model, f"ipc://{tmp / f'{name}.sock'}", *extra))
            for name, extra in daemons.items()
        }
        clients = {name: stack.enter_context(Client(proc.address, timeout=3600)) for name, proc in procs.items()}
        model = clients["cache"].health()["model"]
        context, vocab = int(model["context_length"]), int(model["vocab_size"])
        meta["context_length"] = context
        if (why := plan.too_long(context)) is not None:
            raise CommandError(why)
        snapshot = clients["cache"].stats()["engine"].get("prefix_cache") or {}
        meta["prefix_cache"] = {k: snapshot.get(k) for k in ("serving", "max_bytes", "verdict")}
        if not snapshot.get("serving"):
            print(
                f"warning: the cache daemon's prefix cache is not serving: {snapshot.get('verdict')}", file=sys.stderr
            )
        wait_idle(clients)
        for part in plan.parts:
            PREFIX_RUNNERS[part](plan, clients, vocab, result, step)
            finished(part)
    exit_codes = {name: proc.proc.returncode for name, proc in procs.items()}
    for name, code in exit_codes.items():
        if code != 0:
            print(f"warning: the '{name}' daemon exited with {code} after SIGTERM", file=sys.stderr)
    meta["daemon_exit_codes"] = exit_codes
    print(write_prefix(result, out))
    print(f"results in {out.resolve()}", flush=True)
    return 0


def _prefix_ttft(
    plan: PrefixPlan, clients: dict[str, Any], vocab: int, result: dict[str, Any], step: Callable[[str], None]
) -> None:
    """TTFT through the cache daemon, one request at a time: the first request of each new prefix
    (cold), then ``plan.warm`` with new suffixes (warm). An untimed prefix first: its cold and one
    warm request pay first-use costs."""
    cache = clients["cache"]
    rng = random.Random(17)
    progress("bench prefix: TTFT warm-up (untimed)")
    warm_up = _random_tokens(rng, plan.prefix, vocab)
    for _ in range(2):
        timed_request(cache, warm_up + _random_tokens(rng, plan.suffix, vocab), TTFT_TOKENS)
    requests: list[dict[str, Any]] = []
    for rep in range(plan.repeats):
        prefix = _random_tokens(rng, plan.prefix, vocab)
        for i in range(1 + plan.warm):
            wait_idle(clients)
            r = timed_request(cache, prefix + _random_tokens(rng, plan.suffix, vocab), TTFT_TOKENS)
            kind = "cold" if i == 0 else "warm"
            requests.append({"repeat": rep, "kind": kind, **{k: v for k, v in r.items() if k != "tokens"}})
            step(
                f"TTFT prefix {rep + 1}/{plan.repeats}, {kind}: {r['ttft_s'] * 1e3:.1f} ms "
                f"({r['hit_tokens']} of {r['prompt_tokens']} tokens from the cache)"
            )
    result["ttft_requests"] = requests
    result["ttft"] = prefix_ttft_rows(requests)


def _prefix_chat(
    plan: PrefixPlan, clients: dict[str, Any], vocab: int, result: dict[str, Any], step: Callable[[str], None]
) -> None:
    """Each conversation on both daemons, in an order rotated per repeat; a first message and user
    messages of their own per conversation, so no conversation starts from another's entries."""
    progress("bench prefix: chat warm-up (untimed)")
    for arm in PREFIX_ARMS:
        timed_request(clients[arm], _random_tokens(random.Random(98), plan.system + plan.user, vocab), plan.answer)
    chats = []
    for rep in range(plan.repeats):
        crng = random.Random(1700 + rep)
        system = _random_tokens(crng, plan.system, vocab)
        users = [_random_tokens(crng, plan.user, vocab) for _ in range(plan.turns)]
        chat: dict[str, Any] = {}
        for arm in rotated(list(PREFIX_ARMS), rep):
            wait_idle(clients)
            chat[arm] = run_chat(clients[arm], system, users, plan.answer)
            step(
                f"chat {rep + 1}/{plan.repeats}, {arm}: {chat[arm]['computed_tokens']} of "
                f"{chat[arm]['prompt_tokens']} prompt tokens prefilled in {chat[arm]['seconds']:.2f} s"
            )
        chats.append(chat)
    result["chats"] = chats
    result["chat_rows"] = prefix_chat_rows(chats)


def _prefix_throughput(
    plan: PrefixPlan, clients: dict[str, Any], vocab: int, result: dict[str, Any], step: Callable[[str], None]
) -> None:
    """The matrix's workload at ``plan.batch`` (distinct random prompts: nothing to reuse) on both
    daemons, rotated per repeat; the cache daemon's hits during the timed runs are counted."""
    progress(f"bench prefix: throughput warm-up at B = {plan.batch} (untimed)")
    for arm in PREFIX_ARMS:
        run_daemon(clients[arm], _prompts(plan.batch, plan.prompt_tokens, vocab, seed=99), min(8, plan.tokens))
    samples: dict[str, list[float]] = {}
    runs = []
    before = prefix_counters(clients["cache"])
    for rep in range(plan.repeats):
        prompts = _prompts(plan.batch, plan.prompt_tokens, vocab, seed=17_000 + rep)
        for position, arm in enumerate(rotated(list(PREFIX_ARMS), rep)):
            wait_idle(clients)
            n, wall = run_daemon(clients[arm], prompts, plan.tokens)
            samples.setdefault(arm, []).append(n / wall)
            runs.append({"repeat": rep, "position": position, "arm": arm, "tokens": n, "seconds": wall})
            step(f"B = {plan.batch}, repeat {rep + 1}/{plan.repeats}, {arm}: {n / wall:.1f} tok/s")
    moved = _delta(prefix_counters(clients["cache"]), before)
    result["throughput_runs"] = runs
    result["throughput"] = prefix_throughput_row(
        samples, plan.batch, {k: moved[k] for k in ("hits", "hit_tokens", "lookup_tokens")}
    )


#: ``--prefix-parts`` -> the function that runs it and stores its results.
PREFIX_RUNNERS: dict[str, Callable[[PrefixPlan, dict[str, Any], int, dict[str, Any], Callable[[str], None]], None]] = {
    "ttft": _prefix_ttft,
    "chat": _prefix_chat,
    "throughput": _prefix_throughput,
}
