"""Where a request's time goes through a daemon: its first token, the gaps between tokens, the
engine's own account of it, and the wall time outside the engine's steps.

    python benchmarks/b1_timeline.py --model demo --tokens 128 --repeats 6 --out timeline.json
    python benchmarks/b1_timeline.py --model "$M" --batches 1,8 --out timeline.json
    python benchmarks/b1_timeline.py --model demo --daemon-args='--admit-window-ms 0' --out nowindow.json

One daemon (``mlx-batchd serve``, its defaults unless ``--daemon-args``), B requests at a time, all
streamed from one event loop through one client (as ``mlx-batchd bench``'s daemon arm sends them).
For each repeat and request: milliseconds to the first token event and to the end, the median and
largest gap between token events, and the engine's timings from the end event (``queue_s``: from the
engine's submit to its prefill, the admission window included; ``total_s``: submit to end). Per
repeat, the engine's step counters (``stats``) give ``outside_steps_ms``: the wall time of the
repeat that the engine's steps do not account for (admission, the hops between processes, the
loop's own work between steps). ``hops_ms`` (client wall minus the engine's ``total_s``) is the part
spent between the client and the engine thread, both ways; ``emit_ms`` (``stats.engine.loop``) is
the engine thread's time handing each step's events to the front end, and ``idle_hold_ms``
(``stats.engine.admission``) the time the idle engine held the repeat's first arrivals until the
declared group was whole (the front end's intake of the group), both inside ``outside_steps_ms``.
On Linux each repeat also reads the CPU time (``/proc``) of the daemon's front end process, its
engine process and this client process, per generated token: what the daemon's Python costs next to
the engine's own work. ``placement`` records the CPUs the front end and the engine ran on
(``serve --cpu-affinity``; compare a run with ``--daemon-args="--cpu-affinity off"``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402

from clients import AsyncClient, Client  # noqa: E402
from clients.events import EndEvent  # noqa: E402
from scheduler.bench.arms import STEP_COUNTERS as COUNTERS  # noqa: E402
from scheduler.bench.arms import random_prompts, step_counters  # noqa: E402
from scheduler.bench.process_cpu import cpu_seconds, daemon_processes  # noqa: E402
from scheduler.spawn import DaemonProcess  # noqa: E402


async def one(
    client: AsyncClient, prompt: list[int], tokens: int, start: float, group: tuple[str, int]
) -> dict[str, Any]:
    """One streamed request of a declared ``group``; times from ``start`` (the repeat's start) and
    from its own send."""
    tic = time.perf_counter()
    arrivals: list[float] = []
    timings: dict[str, Any] = {}
    produced = 0
    async for event in client.stream(tokens=prompt, max_tokens=tokens, group=group):
        if isinstance(event, EndEvent):
            timings = dict(event.timings)
        elif event.tokens:
            arrivals.append(time.perf_counter() - tic)
            produced += len(event.tokens)
    end = time.perf_counter() - tic
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])] or [0.0]
    total = timings.get("total_s") or 0.0
    return {
        "tokens": produced,
        "sent_ms": 1e3 * (tic - start),
        "first_token_ms": 1e3 * arrivals[0],
        "end_ms": 1e3 * end,
        "gap_median_ms": 1e3 * statistics.median(gaps),
        "gap_max_ms": 1e3 * max(gaps),
        "queue_ms": 1e3 * (timings.get("queue_s") or 0.0),
        "engine_ttft_ms": 1e3 * (timings.get("ttft_s") or 0.0),
        "engine_total_ms": 1e3 * total,
        "hops_ms": 1e3 * (end - total),
    }


def streamed(address: str, prompts: list[list[int]], tokens: int) -> tuple[list[dict[str, Any]], float]:
    """Every prompt streamed at once from one event loop and declared one group (as the bench's
    daemon arm sends them, ``generate_many``), on a connection opened before the clock starts; the
    requests and the wall."""
    out: list[dict[str, Any]] = [{} for _ in prompts]
    group = (uuid.uuid4().hex, len(prompts))

    async def main() -> float:
        async with AsyncClient(address, timeout=600) as client:
            await client.health()
            tic = time.perf_counter()

            async def run(i: int) -> None:
                out[i] = await one(client, prompts[i], tokens, tic, group)

            async with anyio.create_task_group() as tasks:
                for i in range(len(prompts)):
                    tasks.start_soon(run, i)
            return time.perf_counter() - tic

    wall = anyio.run(main)
    return out, wall


def processes(daemon_pid: int) -> dict[str, int]:
    """The front end (the daemon), its engine process (where it has one) and this client."""
    return {**daemon_processes(daemon_pid), "client": os.getpid()}


def repeat(client: Client, prompts: list[list[int]], tokens: int, pids: dict[str, int]) -> dict[str, Any]:
    before = step_counters(client.stats()["engine"])
    started_at = time.time()  # wall-clock, to line a repeat up with a log of the GPU's clocks
    cpu_before = {k: cpu_seconds(pid) for k, pid in pids.items()}
    requests, wall = streamed(client.address, prompts, tokens)
    cpu_after = {k: cpu_seconds(pid) for k, pid in pids.items()}
    after = step_counters(client.stats()["engine"])
    delta = {k: after[k] - before[k] for k in after}
    steps = {k: delta[k] for k in COUNTERS}
    step_ms = 1e3 * steps["decode_seconds"] / max(1, steps["decode_steps"])
    return {
        "batch": len(prompts),
        "started_at": started_at,
        "wall_ms": 1e3 * wall,
        "engine": steps,
        # Issue 15's streaming bound: the median gap between a request's tokens over the decode step.
        # NaN where no decode step ran (--tokens 1): the print and the medians then still work.
        "gap_over_step": statistics.median(r["gap_median_ms"] for r in requests) / step_ms if step_ms else math.nan,
        "outside_steps_ms": 1e3 * (wall - steps["step_seconds"]),
        "loop_iterations": delta["iterations"],
        "emit_ms": 1e3 * delta["emit_seconds"],
        # An idle engine holding the repeat's arrivals until its declared group was whole: wall time
        # outside the steps that the front end's intake of the group costs.
        "idle_hold_ms": 1e3 * delta["idle_hold_seconds"],
        "cpu_ms_per_token": {
            k: 1e3 * (b - a) / max(1, sum(r["tokens"] for r in requests))
            for k, (a, b) in ((k, (cpu_before[k], cpu_after[k])) for k in pids)
            if a is not None and b is not None
        },
        "requests": requests,
    }


REQUEST_KEYS = ("sent_ms", "first_token_ms", "end_ms", "gap_median_ms", "queue_ms", "engine_total_ms", "hops_ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--batches", default="1", help="requests at a time, comma-separated (each gets --repeats)")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--daemon-args", default="", help="extra `serve` options, after '='")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    folder = tempfile.mkdtemp(prefix="mlx-batchd-timeline-")
    rows = []
    batches = [int(b) for b in a.batches.split(",")]
    with (
        DaemonProcess(a.model, f"ipc://{folder}/d.sock", *shlex.split(a.daemon_args)) as proc,
        Client(proc.address, timeout=600) as client,
    ):
        vocab = int(client.wait_ready(timeout=120).get("vocab_size", 256) or 256)
        pids = processes(proc.proc.pid)
        stats = client.stats()
        placement = {"front_end_cpus": stats.get("front_end_cpus"), "engine_cpus": stats["engine"]["loop"].get("cpus")}
        print("placement:", json.dumps(placement), flush=True)
        for b in batches:
            repeat(client, random_prompts(b, a.prompt_tokens, vocab, seed=99), 8, pids)  # first steps at B, untimed
            for rep in range(a.repeats):
                row = repeat(client, random_prompts(b, a.prompt_tokens, vocab, seed=1 + rep), a.tokens, pids)
                rows.append(row)
                e, med = row["engine"], {k: statistics.median(r[k] for r in row["requests"]) for k in REQUEST_KEYS}
                print(
                    f"B={b} repeat {rep + 1}/{a.repeats}: wall {row['wall_ms']:.1f} ms; engine {e['steps']} steps in "
                    f"{1e3 * e['step_seconds']:.1f} ms ({e['decode_steps']} decode, "
                    f"{1e3 * e['decode_seconds'] / max(1, e['decode_steps']):.2f} ms each; engine thread's CPU "
                    f"{1e3 * e['step_cpu_seconds']:.1f} ms of them, preempted {e['step_preemptions']}x); outside the steps "
                    f"{row['outside_steps_ms']:.1f} ms, of which handing events over {row['emit_ms']:.1f} ms in "
                    f"{row['loop_iterations']} loop iterations and holding the group {row['idle_hold_ms']:.1f} ms; median gap / decode step {row['gap_over_step']:.3f}; "
                    "CPU ms a token: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in row["cpu_ms_per_token"].items())
                    + "; a request (median): "
                    + ", ".join(f"{k} {v:.2f}" for k, v in med.items()),
                    flush=True,
                )
    summary = {
        str(b): {
            k: statistics.median(r[k] for r in rows if r["batch"] == b)
            for k in ("wall_ms", "outside_steps_ms", "emit_ms", "idle_hold_ms", "gap_over_step")
        }
        | {k: statistics.median(q[k] for r in rows if r["batch"] == b for q in r["requests"]) for k in REQUEST_KEYS}
        for b in batches
    }
    print("medians:", json.dumps({b: {k: round(v, 2) for k, v in s.items()} for b, s in summary.items()}))
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "args": vars(a),
                    # The project's variables the daemon inherited (workers/envs.py, clients/envs.py).
                    "environment": {k: v for k, v in os.environ.items() if k.startswith("MLX_BATCHD_")},
                    "placement": placement,
                    "rows": rows,
                    "medians": summary,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
