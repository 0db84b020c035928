"""Device measurement: does a host-bound decode step's speed depend on which CPU the engine thread runs on?

    python benchmarks/cpu_placement_probe.py --model "$M" --tokens 128 --rounds 3 --out placement.json

On the H200 host a B = 1 decode step of the 8B synth moved between 4.4 and 7.5 ms from one process to
another with the same kernel plans, and on the H100 host the engine thread's own CPU time was 97 % of
every B = 1 step's wall: the step waits on the host, not on the device. If the host's speed depends
on where the thread runs (the NUMA node next to the GPU against the far one, a CPU whose sibling
is busy), pinning the engine thread would both speed B = 1 up and make it reproducible.

The engine runs in this process on the main thread, as the bench's engine arm, one sequence of
``--tokens`` at a time. Each round runs the arm ``all`` (the thread on every CPU this process may
use, the OS placing it) and one arm per CPU (the thread pinned to that CPU alone; MLX's own threads
stay where they were), in a rotated order. Per run: milliseconds per decode step (the engine's
counters), the engine thread's CPU seconds inside the steps over their wall, its preemptions, and
the CPUs the thread was seen on (``/proc``'s field 39, read between steps). The machine's NUMA
nodes, CPU siblings and the GPU's node (``/sys``) go in the JSON with the runs.

``--arms`` names other arms: ``C`` (pinned to CPU C), ``all``, and ``C+spin:Y`` (pinned to C while
another process spins on CPU Y: does work on another CPU slow the engine's, as a VM's vCPUs that
share a core would?) or ``C+write:Y`` (pinned to C, writing 600 bytes to a pipe after every step
that a process on CPU Y reads: what handing a step's events to another process, as the daemon's
engine thread does, costs the steps themselves, beyond the write's own time). For example
``--arms 2,2+spin:15,2+write:15,2+spin:3``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.bench.arms import random_prompts, step_counters  # noqa: E402
from scheduler.bench.process_cpu import last_cpu  # noqa: E402


def topology() -> dict[str, Any]:
    """NUMA nodes' CPUs, each CPU's siblings and the NVIDIA devices' NUMA node, from Linux's ``/sys``
    (empty where absent)."""
    sys_dir = Path("/sys/devices/system")
    nodes = {p.name: p.joinpath("cpulist").read_text().strip() for p in sorted(sys_dir.glob("node/node[0-9]*"))}
    siblings = {}
    for p in sorted(sys_dir.glob("cpu/cpu[0-9]*/topology/thread_siblings_list")):
        siblings[p.parts[-3]] = p.read_text().strip()
    gpus = {}
    for dev in sorted(Path("/sys/bus/pci/devices").glob("*")):
        try:
            if dev.joinpath("vendor").read_text().strip() == "0x10de" and dev.joinpath("class").read_text().startswith(
                "0x0302"
            ):
                gpus[dev.name] = {
                    "numa_node": dev.joinpath("numa_node").read_text().strip(),
                    "local_cpulist": dev.joinpath("local_cpulist").read_text().strip(),
                }
        except OSError:
            continue
    return {"nodes": nodes, "siblings": siblings, "gpus": gpus}


def one_run(engine: Any, prompt: list[int], tokens: int, after_step: Any = None) -> dict[str, Any]:
    """One sequence through the engine on this thread; its decode steps' counters. ``after_step``
    (no arguments) runs after every step, outside the step's timing."""
    from workers.api import Job, Tokens

    before = step_counters(asdict(engine.counters))
    pid, tid = os.getpid(), threading.get_native_id()
    cpus: dict[int, int] = {}
    tic = time.perf_counter()
    engine.submit(Job(seq=0, prompt=prompt, max_tokens=tokens))
    produced = 0
    while engine.has_work:
        produced += sum(len(e.tokens) for e in engine.step() if isinstance(e, Tokens))
        if after_step is not None:
            after_step()
        cpu = last_cpu(pid, tid)
        if cpu is not None:
            cpus[cpu] = cpus.get(cpu, 0) + 1
    wall = time.perf_counter() - tic
    after = step_counters(asdict(engine.counters))
    d = {k: after[k] - before[k] for k in after}
    steps = d["steps"] or 1
    return {
        "tokens": produced,
        "wall_s": wall,
        "decode_step_ms": 1e3 * d["decode_seconds"] / max(1, d["decode_steps"]),
        "cpu_over_wall": d["step_cpu_seconds"] / d["step_seconds"] if d["step_seconds"] else 0.0,
        "preemptions_per_step": d["step_preemptions"] / steps,
        "cpus_seen": {str(k): v for k, v in sorted(cpus.items())},
    }


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Each run's decode step in the order the runs were made, one marker per arm: a placement that
    matters shows as an arm apart from the others; drift over time, as every arm moving together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scheduler.bench.output import save_png

    fig, ax = plt.subplots(figsize=(9, 4))
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    for i, arm in enumerate(arms):
        points = [(n, r["decode_step_ms"]) for n, r in enumerate(runs) if r["arm"] == arm]
        x, y = zip(*points)
        marker, size, color = ("s", 6, "k") if arm == "all" else ("o", 4, f"C{i % 10}")
        ax.plot(x, y, marker, label=arm, markersize=size, color=color, linestyle="none")
    ax.set_xlabel("run, in the order made (rounds rotate the arms)")
    ax.set_ylabel("B = 1 decode step (ms)")
    ax.set_title("engine thread pinned to one CPU (or left to the OS: all)")
    ax.grid(alpha=0.3)
    ax.legend(ncol=min(9, len(arms)), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    save_png(fig, path)


SPIN = "while True:\n    pass"
READ = "import os\nwhile os.read(0, 65536):\n    pass"


def disturbed_run(engine: Any, prompt: list[int], tokens: int, arm: str, allowed: list[int]) -> dict[str, Any]:
    """One run of ``arm`` (``all``, ``C``, ``C+spin:Y``, ``C+write:Y``): the engine thread placed, the
    disturbance started before and stopped after."""
    place, _, disturbance = arm.partition("+")
    kind, _, at = disturbance.partition(":")
    helper = None
    after_step = None
    if kind:
        code = SPIN if kind == "spin" else READ
        helper = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        os.sched_setaffinity(helper.pid, {int(at)})  # not in the child before exec: this process has threads
        if kind == "write":
            fd, payload = helper.stdin.fileno(), bytes(600)  # type: ignore[union-attr]
            after_step = lambda: os.write(fd, payload)  # noqa: E731
        time.sleep(0.2)  # the helper running before the first step
    os.sched_setaffinity(0, set(allowed) if place == "all" else {int(place)})
    try:
        return one_run(engine, prompt, tokens, after_step)
    finally:
        os.sched_setaffinity(0, set(allowed))
        if helper is not None:
            helper.kill()
            helper.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpus", default="", help="comma-separated CPUs to pin to (default: every allowed CPU)")
    parser.add_argument("--arms", default="", help="comma-separated arms (see above); default: all and each CPU")
    parser.add_argument("--out", type=Path, default=None, help="JSON; a PNG of the runs beside it")
    parser.add_argument("--plot-from", type=Path, default=None, help="only draw the PNG of a saved JSON")
    args = parser.parse_args()
    if args.plot_from is not None:
        plot(json.loads(args.plot_from.read_text())["runs"], args.plot_from.with_suffix(".png"))
        return

    import mlx.core as mx

    from workers.api import EngineSettings
    from workers.engine.engine import Engine
    from workers.engine.startup import buffer_cache_limit
    from workers.kernels.backend import configure_attention
    from workers.models.loading import load

    allowed = sorted(os.sched_getaffinity(0))
    cpus = [int(c) for c in args.cpus.split(",") if c] or allowed
    loaded = load(args.model)
    mx.set_cache_limit(buffer_cache_limit(EngineSettings()))
    configure_attention(EngineSettings().cudnn_attention)
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size, max_batch=32)
    prompt = random_prompts(1, 32, loaded.info.vocab_size, 0)[0]
    one_run(engine, prompt, 16)  # warm-up: kernels compiled, plans loaded
    arms: list[str] = [a for a in args.arms.split(",") if a] or ["all", *(str(c) for c in cpus)]
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        for arm in order:
            run = disturbed_run(engine, prompt, args.tokens, arm, allowed)
            run |= {"arm": arm, "round": r}
            runs.append(run)
            print(
                f"round {r} {arm:>10}: {run['decode_step_ms']:.2f} ms/step, cpu/wall {run['cpu_over_wall']:.2f}, "
                f"preempt/step {run['preemptions_per_step']:.2f}, seen {run['cpus_seen']}",
                flush=True,
            )
    print("\n| arm | decode step ms (median, min-max) | engine thread CPU / wall |")
    print("|---|---|---|")
    summary = {}
    for arm in arms:
        ms = [x["decode_step_ms"] for x in runs if x["arm"] == arm]
        cw = [x["cpu_over_wall"] for x in runs if x["arm"] == arm]
        summary[arm] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}
        print(f"| {arm} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) | {statistics.median(cw):.2f} |")
    topo = topology()
    print(json.dumps(topo))
    if args.out:
        args.out.write_text(json.dumps({"topology": topo, "summary": summary, "runs": runs}, indent=1))
        plot(runs, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
