"""Mixed arrivals: requests at Poisson times through one async client, with client-side TTFT,
inter-token and end-to-end percentiles, and their JSON, Markdown and PNG."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from scheduler.bench.output import save_png, write_whole


def run_poisson(
    address: str,
    rate: float,
    n: int,
    vocab: int,
    max_tokens: int,
    seed: int = 7,
    prompt_lengths: tuple[int, int] = (4, 64),
    fixed_tokens: int | None = None,
) -> dict[str, Any]:
    """Mixed arrivals: ``n`` requests at Poisson times (``rate`` per second), prompt lengths drawn
    from ``prompt_lengths`` (low inclusive, high exclusive; equal: one length) and budgets drawn from
    8 to ``max_tokens`` (or each ``fixed_tokens``), through one async client; client-side TTFT,
    inter-token gaps, durations, and each request's generated tokens."""
    import anyio

    from clients.client import AsyncClient
    from clients.events import TokenEvent

    rng = random.Random(seed)
    low, high = prompt_lengths
    plan = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        length = rng.randrange(low, high) if high > low else low
        budget = fixed_tokens if fixed_tokens else rng.randrange(8, max_tokens + 1)
        plan.append((t, [rng.randrange(4, min(vocab, 256)) for _ in range(length)], budget))
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    produced: list[int] = []

    async def one(client: AsyncClient, at: float, prompt: list[int], budget: int, start: float) -> None:
        await anyio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = last = time.perf_counter()
        first = True
        count = 0
        async for ev in client.stream(tokens=prompt, max_tokens=budget):
            if isinstance(ev, TokenEvent) and ev.tokens:
                count += len(ev.tokens)
                now = time.perf_counter()
                if first:
                    ttft.append(now - sent)
                    first = False
                else:
                    itl.extend([(now - last) / len(ev.tokens)] * len(ev.tokens))
                last = now
        e2e.append(time.perf_counter() - sent)
        produced.append(count)

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
        "budgets": f"{fixed_tokens} tokens each" if fixed_tokens else f"8-{max_tokens} tokens",
        "tokens": produced,
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
    if result.get("budgets"):
        md += f"\n{result['requests']} requests at {result['rate']:g}/s, budgets {result['budgets']}.\n"
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
