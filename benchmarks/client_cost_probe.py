"""What serving many streams costs each process outside the engine: CPU a token and a request.

    python benchmarks/client_cost_probe.py                      # 128 requests x 32 tokens, 4 trials
    python benchmarks/client_cost_probe.py --tokens 1 --groups 16   # per request (1-token requests)

A real daemon (``--model``, default the demo) at ``--max-batch`` = ``--requests``; one blocking client
sends ``--requests`` requests with ``generate_many`` (one declared group), ``--groups`` times a trial.
Per trial: the client's CPU (this process), the front end's (and its event loop's thread alone) and the
engine process's (``/proc``, Linux),
each over the tokens (and the requests) the trial produced. CPU seconds, not wall: a process that takes
more CPU a token runs out of a core at a lower token rate (B = 128 on the H200 is ~3,200 tokens a second).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients import Client  # noqa: E402
from scheduler.bench import process_cpu  # noqa: E402
from scheduler.spawn import DaemonProcess  # noqa: E402


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """``process_cpu.cpu_seconds``, which this Linux-only probe needs to have an answer."""
    seconds = process_cpu.cpu_seconds(pid, tid)
    if seconds is None:
        raise SystemExit("client_cost_probe: needs Linux's /proc")
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--groups", type=int, default=1, help="generate_many calls a trial")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--idle-seconds", type=float, default=10.0, help="first, the processes' CPU with nothing to do")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    folder = tempfile.mkdtemp(prefix="mlx-batchd-client-cost-")
    args = ("--max-batch", str(a.requests), "--max-tokens", str(max(a.tokens, 8)))
    rows = []
    with DaemonProcess(a.model, f"ipc://{folder}/d.sock", *args) as proc, Client(proc.address, timeout=600) as c:
        c.wait_ready(timeout=180)
        front = proc.proc.pid
        engine = process_cpu.daemon_processes(front)["engine_process"]
        jobs = [{"tokens": [5 + i % 50, 6, 7, 8], "max_tokens": a.tokens} for i in range(a.requests)]
        c.generate_many(jobs)  # untimed: the first group at this size
        # What the processes spend with nothing to serve (their timers' wake-ups): a trial's CPU a
        # token holds this much a second of its wall time too.
        time.sleep(1.0)
        f0, e0 = cpu_seconds(front), cpu_seconds(engine)
        time.sleep(a.idle_seconds)
        idle = {
            "front_end": (cpu_seconds(front) - f0) / a.idle_seconds,
            "engine_process": (cpu_seconds(engine) - e0) / a.idle_seconds,
        }
        print("idle, CPU ms a second:", json.dumps({k: round(1e3 * v, 1) for k, v in idle.items()}), flush=True)
        for trial in range(a.trials):
            f0, l0, e0 = cpu_seconds(front), cpu_seconds(front, front), cpu_seconds(engine)
            c0, w0 = time.process_time(), time.perf_counter()
            tokens = sum(r.usage["completion_tokens"] for _ in range(a.groups) for r in c.generate_many(jobs))
            wall = time.perf_counter() - w0
            cpu = {"client": time.process_time() - c0, "front_end": cpu_seconds(front) - f0}
            cpu["front_end_loop"] = cpu_seconds(front, front) - l0  # its event loop's thread alone
            cpu["engine_process"] = cpu_seconds(engine) - e0
            n = a.groups * a.requests
            row = {
                "trial": trial,
                "tokens": tokens,
                "requests": n,
                "wall_s": wall,
                "us_per_token": {k: 1e6 * v / tokens for k, v in cpu.items()},
                "us_per_request": {k: 1e6 * v / n for k, v in cpu.items()},
            }
            rows.append(row)
            print(
                f"trial {trial + 1}/{a.trials}: {n} requests, {tokens} tokens in {wall:.2f} s; CPU a token (us): "
                + ", ".join(f"{k} {v:.1f}" for k, v in row["us_per_token"].items()),
                flush=True,
            )
    medians = {k: statistics.median(r["us_per_token"][k] for r in rows) for k in rows[0]["us_per_token"]}
    per_request = {k: statistics.median(r["us_per_request"][k] for r in rows) for k in rows[0]["us_per_request"]}
    print("medians, CPU a token (us):", json.dumps({k: round(v, 1) for k, v in medians.items()}))
    print("medians, CPU a request (us):", json.dumps({k: round(v, 1) for k, v in per_request.items()}))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "idle_cpu_per_s": idle, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
