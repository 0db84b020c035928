"""``mlx-batchd bench``: the workload matrix, one command.

Batched decode throughput vs B through the daemon (scoped pins), through a daemon with a process-wide
pin (``--process-pin``) and through raw ``BatchGenerator``; B = 1 classic vs bursts per drafter
(``--drafters``, one daemon each); mixed Poisson arrivals with TTFT / inter-token percentiles; the
start-up probe's time per daemon. JSON, Markdown tables and PNG plots land in ``--out``.

Both arms run the same workload in the same run: B greedy sequences with random prompts of the
same length, every request submitted at once, timed from the first submit to the last token.
The raw arm drives ``BatchGenerator`` in this process; the daemon arm drives a daemon child
process through the client library, as a user would. Arms alternate per repeat so that drift
in the machine's speed hits both; the median of the repeats is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast


def _prompts(b: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, min(vocab, 256)) for _ in range(n)] for _ in range(b)]


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
    (out / "poisson.json").write_text(json.dumps({"meta": meta, "result": result}, indent=2))
    md = "| metric | p50 | p90 | p99 |\n|---|---|---|---|\n" + "".join(
        f"| {name} (ms) | {result[f'{name}_p50'] * 1e3:.1f} | {result[f'{name}_p90'] * 1e3:.1f} | {result[f'{name}_p99'] * 1e3:.1f} |\n"
        for name in ("ttft", "itl", "e2e")
    )
    (out / "poisson.md").write_text(md)
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
    fig.tight_layout()
    fig.savefig(out / "poisson.png", dpi=120)
    return md


def write_report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    """JSON, a Markdown table and a PNG plot; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "daemon_vs_raw.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    pinned = "daemon_process_pin_tok_s" in rows[0]
    roof = rows[0].get("reference_tok_s") is not None
    head = (
        "| B | raw BatchGenerator tok/s | engine alone tok/s | daemon tok/s | daemon / raw | daemon / engine "
        "| spread (daemon, min-max) |"
    )
    rule = "|---|---|---|---|---|---|---|"
    if pinned:
        head += " daemon, process pin tok/s | process pin / scoped |"
        rule += "---|---|"
    if roof:
        head += " physical limit tok/s | daemon / limit |"
        rule += "---|---|"

    def row(r: dict[str, Any]) -> str:
        lo, hi = r["daemon_spread"]
        line = (
            f"| {r['batch']} | {r['raw_tok_s']:.1f} | {r['engine_tok_s']:.1f} | {r['daemon_tok_s']:.1f} "
            f"| {r['ratio']:.3f} | {r['daemon_tok_s'] / r['engine_tok_s']:.3f} | {lo:.1f}-{hi:.1f} |"
        )
        if pinned:
            line += f" {r['daemon_process_pin_tok_s']:.1f} | {r['daemon_process_pin_tok_s'] / r['daemon_tok_s']:.3f} |"
        if roof:
            line += f" {r['reference_tok_s']:.0f} | {r['daemon_tok_s'] / r['reference_tok_s']:.3f} |"
        return line

    lines = [head, rule, *(row(r) for r in rows)]
    md = "\n".join(lines) + "\n"
    (out / "daemon_vs_raw.md").write_text(md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    bs = [r["batch"] for r in rows]
    ax.plot(bs, [r["raw_tok_s"] for r in rows], "o-", label="raw BatchGenerator")
    ax.plot(bs, [r["engine_tok_s"] for r in rows], "x--", label="engine alone (in process)")
    ax.plot(bs, [r["daemon_tok_s"] for r in rows], "s-", label="daemon, scoped pins (client over ipc)")
    if pinned:
        ax.plot(bs, [r["daemon_process_pin_tok_s"] for r in rows], "^-", label="daemon, process-wide pin")
    ax.set_xlabel("concurrent sequences (B)")
    ax.set_ylabel("generated tokens / s")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{meta['model']} on {meta['device']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "daemon_vs_raw.png", dpi=120)
    return md


def drafter_args(spec: str) -> list[str]:
    """Daemon flags for one drafter spec: ``mtp:DIR|demo`` is an MTP head, anything else ``--draft``."""
    return ["--mtp", spec.split(":", 1)[1]] if spec.startswith("mtp:") else ["--draft", spec]


def _burst_counts(client: Any) -> dict[str, int]:
    b = client.stats()["engine"].get("bursts", {})
    return {k: int(b.get(k, 0)) for k in ("rounds", "drafted_tokens", "accepted_tokens", "emitted_tokens")}


def b1_rows(
    samples: dict[tuple[str, int], list[float]],
    counts: dict[str, dict[str, int]],
    verdicts: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """B = 1 through the daemon: classic (no drafter) vs each drafter's bursts, same prompts and repeats."""
    classic = statistics.median(samples[("daemon", 1)])
    rows: list[dict[str, Any]] = [
        {
            "drafter": "classic (no drafter)",
            "tok_s": classic,
            "speedup": 1.0,
            "acceptance": None,
            "tokens_per_round": None,
            "verdict": "-",
        }
    ]
    for arm, c in counts.items():
        rate = statistics.median(samples[(arm, 1)])
        v = verdicts.get(arm, {})
        rows.append(
            {
                "drafter": arm.removeprefix("bursts:"),
                "tok_s": rate,
                "speedup": rate / classic,
                "acceptance": c["accepted_tokens"] / c["drafted_tokens"] if c["drafted_tokens"] else None,
                "tokens_per_round": c["emitted_tokens"] / c["rounds"] if c["rounds"] else None,
                "verdict": f"{v.get('level') or 'declined'}{'' if v.get('exact', False) else ' (inexact)'}",
            }
        )
    return rows


def write_b1(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    """B = 1 classic vs bursts: JSON, Markdown, PNG; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "b1_bursts.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    md = (
        "| drafter | tok/s | vs classic | acceptance | tokens/round | verdict |\n|---|---|---|---|---|---|\n"
        + "".join(
            f"| {r['drafter']} | {r['tok_s']:.1f} | {r['speedup']:.3f} | {cell(r['acceptance'], '.3f')} "
            f"| {cell(r['tokens_per_round'], '.2f')} | {r['verdict']} |\n"
            for r in rows
        )
    )
    (out / "b1_bursts.md").write_text(md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 0.6 * len(rows) + 1.5))
    ax.barh([r["drafter"] for r in rows], [r["tok_s"] for r in rows])
    ax.set(
        xlabel="generated tokens / s at B = 1 (daemon, client over ipc)", title=f"{meta['model']} on {meta['device']}"
    )
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "b1_bursts.png", dpi=120)
    return md


def main(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tqdm import tqdm

    from clients.sync import Client
    from scheduler.spawn import DaemonProcess
    from workers import fastpath
    from workers.engine import Engine
    from workers.models import load

    batches = [int(b) for b in args.batch_sizes.split(",")]
    # One model for the in-process arms: the raw arm runs it with the project's patches lifted.
    loaded = load(args.model)
    path = Path(loaded.info.path)
    model = loaded.model
    eos = list(loaded.info.eos_token_ids)
    engine = Engine(
        model,
        eos_token_ids=loaded.info.eos_token_ids,
        vocab_size=loaded.info.vocab_size,
        max_batch=max(32, *batches),
    )
    weight_bytes = sum(v.nbytes for _, v in cast(list[tuple[str, Any]], tree_flatten(model.parameters())))
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    tmp = Path(tempfile.mkdtemp(prefix="mlx-batchd-bench-"))
    drafters = [d for d in (args.drafters or "").split(",") if d]
    samples: dict[tuple[str, int], list[float]] = {}
    poisson: dict[str, Any] | None = None
    cap = ["--max-tokens-cap", str(args.tokens), "--max-batch", str(max(32, *batches))]
    # Every daemon starts at once so their start-up probes overlap; each runs alone while measured.
    daemons: dict[str, list[str]] = {"daemon": cap}
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
    with contextlib.ExitStack() as stack:
        procs = {
            name: stack.enter_context(DaemonProcess(args.model, f"ipc://{tmp / f'{i}.sock'}", *extra))
            for i, (name, extra) in enumerate(daemons.items())
        }
        clients = {name: stack.enter_context(Client(proc.address, timeout=3600)) for name, proc in procs.items()}
        for c in clients.values():
            while any("level" not in v for v in c.stats()["engine"]["verdicts"].values()):
                time.sleep(0.1)  # the start-up probe runs while the daemon is idle: let it finish
        warm = _prompts(2, args.prompt_tokens, vocab, seed=99)
        run_raw(model, eos, warm, 8)
        run_engine(engine, warm, 8)
        for name, c in clients.items():
            run_daemon(c, warm[:1] if name in b1_arms else warm, 8)
        before = {name: _burst_counts(clients[name]) for name in b1_arms}
        arms = ["raw", "engine", "daemon"] + (["daemon_process_pin"] if args.process_pin else [])
        steps = [
            (b, rep, arm) for b in batches for rep in range(args.repeats) for arm in arms + (b1_arms if b == 1 else [])
        ]
        for b, rep, arm in tqdm(steps, desc="bench", unit="run"):
            prompts = _prompts(b, args.prompt_tokens, vocab, seed=1000 * b + rep)
            if arm == "raw":
                n, wall = run_raw(model, eos, prompts, args.tokens)
            elif arm == "engine":
                n, wall = run_engine(engine, prompts, args.tokens)
            else:
                n, wall = run_daemon(clients[arm], prompts, args.tokens)
            samples.setdefault((arm, b), []).append(n / wall)
            mx.clear_cache()  # MLX keeps freed buffers; on one GPU the daemons need that memory
        counts = {name: {k: v - before[name][k] for k, v in _burst_counts(clients[name]).items()} for name in b1_arms}
        probe_seconds: dict[str, float] = {}
        verdicts: dict[str, dict[str, Any]] = {}
        for name, c in clients.items():
            for pairing, v in c.stats()["engine"]["verdicts"].items():
                if "probe_seconds" in v:
                    probe_seconds[f"{name} ({pairing})"] = v["probe_seconds"]
                verdicts[name] = v
        if args.poisson_rate > 0:
            # The production shape: the first drafter's daemon (bursts whenever one request is alone).
            target = b1_arms[0] if b1_arms else "daemon"
            poisson = run_poisson(procs[target].address, args.poisson_rate, args.poisson_requests, vocab, args.tokens)
            poisson["daemon"] = target
    # Every daemon got SIGTERM when the stack closed; anything but 0 is a shutdown bug worth seeing.
    exit_codes = {name: proc.proc.returncode for name, proc in procs.items()}
    for name, code in exit_codes.items():
        if code != 0:
            print(f"warning: the '{name}' daemon exited with {code} after SIGTERM", file=sys.stderr)
    rows = []
    gb_per_s = getattr(args, "bandwidth_gbs", None)
    context = args.prompt_tokens + args.tokens // 2  # the mean context over a sequence's decode
    for b in batches:
        raw = statistics.median(samples[("raw", b)])
        dmn = statistics.median(samples[("daemon", b)])
        row: dict[str, Any] = {
            "batch": b,
            "raw_tok_s": raw,
            "engine_tok_s": statistics.median(samples[("engine", b)]),
            "daemon_tok_s": dmn,
            "ratio": dmn / raw,
            "daemon_spread": [min(samples[("daemon", b)]), max(samples[("daemon", b)])],
            "reference_tok_s": None
            if not gb_per_s
            else reference_tok_s(weight_bytes, loaded.info.kv_bytes_per_token, context, b, gb_per_s),
        }
        if args.process_pin:
            row["daemon_process_pin_tok_s"] = statistics.median(samples[("daemon_process_pin", b)])
        rows.append(row)
    meta = {
        "model": args.model,
        "model_path": str(path),
        "device": str(mx.default_device()),
        "mlx": str(getattr(mx, "__version__", "unknown")),
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "drafters": drafters,
        "process_pin": args.process_pin,
        "probe_seconds": probe_seconds,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": loaded.info.kv_bytes_per_token,
        "bandwidth_gb_s": gb_per_s,
        "fastpath": fastpath.active().name,
        "daemon_exit_codes": exit_codes,
    }
    out = Path(args.out)
    print(write_report(rows, meta, out))
    if 1 in batches and b1_arms:
        print(write_b1(b1_rows(samples, counts, verdicts), meta, out))
    if poisson is not None:
        print(f"Poisson arrivals on the '{poisson['daemon']}' daemon:")
        print(write_poisson(poisson, meta, out))
    if probe_seconds:
        print("probe time: " + ", ".join(f"{k}: {v:.2f}s" for k, v in probe_seconds.items()))
    print(f"results in {out.resolve()}")
    return 0
