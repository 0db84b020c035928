"""The batched table: what a matrix run measures (``Setup``), each batch size's medians, spreads and
ratios, and their JSON, Markdown and PNG (``daemon_vs_raw.*``)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.bench.output import save_png, write_whole
from scheduler.bench.reference import reference_line, reference_tok_s
from scheduler.bench.spreads import ratio_spread, spread, with_spread
from scheduler.bench.startup import startup_markdown


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
    #: With ``min_seconds``, a batch size runs further repeats (all its arms, rotated as before) until
    #: every arm's timed runs add up to this many seconds, up to ``MAX_REPEATS_FACTOR`` x ``repeats``.
    min_seconds: float = 0.0
    #: ``--env-arm`` names, among ``arms``: daemons like ``daemon`` started with extra variables,
    #: each reported with its ratio to ``daemon``.
    env_arms: tuple[str, ...] = ()

    def batched_arms(self, batch: int) -> list[str]:
        """The arms measured at ``batch`` among ``arms``."""
        return [a for a in self.arms if a != "raw" or self.raw_max_batch is None or batch <= self.raw_max_batch]

    def arms_at(self, batch: int) -> list[str]:
        return [*self.batched_arms(batch), *(self.b1_arms if batch == 1 else ())]

    def wants_repeat(self, seconds: dict[tuple[str, int], float], batch: int, done: int) -> bool:
        """Whether ``batch`` runs another repeat after ``done``: always up to ``repeats``; then, with
        ``min_seconds``, while an arm's timed runs add up to less. A one-second run (B = 1 on a GPU)
        moves with the host's drift (a GPU host's B = 1 step moves by tens of percent within
        minutes), which three such runs' median does not settle; a run of many seconds already
        averages it, so only the cheap batch sizes get the extra repeats."""
        if done < self.repeats:
            return True
        if done >= MAX_REPEATS_FACTOR * self.repeats:
            return False
        return any(seconds.get((arm, batch), 0.0) < self.min_seconds for arm in self.arms_at(batch))

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


#: ``Setup.min_seconds`` adds repeats up to this many times ``Setup.repeats``.
MAX_REPEATS_FACTOR = 4

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
        arms = setup.batched_arms(b)
        row: dict[str, Any] = {"batch": b, "repeats": min(len(samples[(arm, b)]) for arm in arms)}
        for arm in arms:
            row[f"{arm}_tok_s"] = statistics.median(samples[(arm, b)])
            row[f"{arm}_spread"] = spread(samples[(arm, b)])
        ratios = [*RATIOS, *((f"{arm}_vs_daemon", arm, "daemon") for arm in setup.env_arms)]
        for key, arm, base in ratios:
            if arm in arms and base in arms:
                row[key] = row[f"{arm}_tok_s"] / row[f"{base}_tok_s"]
                row[f"{key}_spread"] = ratio_spread(samples[(arm, b)], samples[(base, b)])
        row["reference_tok_s"] = setup.reference(b)
        row["kv_bytes_per_step"] = b * setup.kv_bytes_per_token * setup.context
        rows.append(row)
    return rows


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
    envs = list(meta.get("env_arms") or {})
    roof = rows[0].get("reference_tok_s") is not None
    cols = ["B", "raw BatchGenerator tok/s", "engine alone tok/s", "daemon tok/s", "daemon / raw", "daemon / engine"]
    if pinned:
        cols += ["daemon, process pin tok/s", "process pin / scoped"]
    for arm, _ in http:
        cols += [f"{HTTP_LABELS[arm]} tok/s", f"{HTTP_LABELS[arm]} / ZeroMQ"]
    for arm in envs:
        cols += [f"{arm} tok/s", f"{arm} / daemon"]
    limited = ("raw", "engine", "daemon", *envs)  # each arm's fraction of the physical limit
    if roof:
        cols += ["physical limit tok/s", "KV read per step (MB)", f"{' / '.join(limited)} of the limit"]

    def line(r: dict[str, Any]) -> str:
        cells = [str(r["batch"])]
        cells += [with_spread(r.get(f"{a}_tok_s"), r.get(f"{a}_spread"), ".1f") for a in ("raw", "engine", "daemon")]
        cells += [with_spread(r.get(k), r.get(f"{k}_spread"), ".3f") for k in ("ratio", "vs_engine")]
        if pinned:
            cells.append(with_spread(r["daemon_process_pin_tok_s"], r["daemon_process_pin_spread"], ".1f"))
            cells.append(with_spread(r["process_pin_vs_scoped"], r["process_pin_vs_scoped_spread"], ".3f"))
        for arm, key in http:
            cells.append(with_spread(r[f"{arm}_tok_s"], r[f"{arm}_spread"], ".1f"))
            cells.append(with_spread(r[key], r[f"{key}_spread"], ".3f"))
        for arm in envs:
            cells.append(with_spread(r.get(f"{arm}_tok_s"), r.get(f"{arm}_spread"), ".1f"))
            cells.append(with_spread(r.get(f"{arm}_vs_daemon"), r.get(f"{arm}_vs_daemon_spread"), ".3f"))
        if roof:
            limit = r["reference_tok_s"]
            cells += [f"{limit:.0f}", f"{r['kv_bytes_per_step'] / 1e6:.3f}"]
            cells.append(" / ".join(f"{r[f'{a}_tok_s'] / limit:.3f}" if f"{a}_tok_s" in r else "-" for a in limited))
        return "| " + " | ".join(cells) + " |"

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols), *(line(r) for r in rows)]
    counts = {r["batch"]: r.get("repeats", meta.get("repeats", "?")) for r in rows}
    if len(set(counts.values())) > 1:
        by_b = ", ".join(f"B = {b}: {n}" for b, n in counts.items())
        how = f"median of each B's repeats ({by_b}; --min-seconds {meta.get('min_seconds', 0):g})"
    else:
        how = f"median of {next(iter(counts.values()))} repeats"
    notes = [f"tok/s: {how} (min-max); a ratio: ratio of the medians (the range its two arms' samples allow)."]
    if roof:
        weights = int(meta["weight_bytes"])
        gb_s = float(meta["bandwidth_gb_s"])
        notes.append(
            f"physical limit: {weights / 1e9:.3f} GB of weights read once per decode step at {gb_s:g} GB/s"
            + (f" ({meta['bandwidth_source']})" if meta.get("bandwidth_source") else "")
            + " "
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
    for arm, env in (meta.get("env_arms") or {}).items():
        notes.append(
            f"{arm}: a daemon like the daemon arm's, started with "
            + " ".join(f"`{k}={v}`" for k, v in env.items())
            + f" (`--env-arm`); {arm} / daemon is that arm over the daemon arm."
        )
    if meta.get("raw_max_batch") is not None:
        notes.append(f"raw BatchGenerator measured up to B = {meta['raw_max_batch']} only (`--raw-max-batch`).")
    if meta.get("in_process_cpus"):
        cpus = ", ".join(map(str, meta["in_process_cpus"]))
        notes.append(
            f"the raw and engine arms ran on CPUs {cpus}, where the daemon arm's engine process runs "
            "(`cpu_affinity` in the serve config file)."
        )
    if not meta.get("complete", True):
        notes.append(f"incomplete run: batch sizes {meta.get('batches_done')} of {meta.get('batches')}.")
    startup = startup_markdown(meta)
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes) + (f"\n{startup}" if startup else "")


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
        *(
            (arm, "P-", f"{arm} (daemon with {', '.join(f'{k}={v}' for k, v in env.items())})")
            for arm, env in (meta.get("env_arms") or {}).items()
        ),
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
