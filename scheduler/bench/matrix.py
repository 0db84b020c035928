"""``mlx-batchd bench``: the workload matrix, one command.

Batched decode throughput vs B through the daemon (scoped pins), through a daemon with a process-wide
pin (``--process-pin``), through the same daemon's OpenAI-compatible HTTP door (``--via http``: whole
answers and SSE streams), through the engine alone and through raw ``BatchGenerator``; B = 1 classic vs
bursts per drafter (``--drafters``, one daemon each); mixed Poisson arrivals with TTFT / inter-token
percentiles; the start-up probe's time per daemon. ``--env-arm NAME:VAR=VALUE`` adds a daemon arm like
``daemon`` started with extra ``MLX_BATCHD_*`` variables (a kernel path off, say), reported beside it.
Every daemon's start (spawn to ready, to idle) is reported, and with ``--restart-times`` the daemon
arm's second start, alone after the others stopped (spawn to ready, to a short request's first
token). JSON, Markdown tables and PNG plots land in ``--out``, rewritten after every batch size, so
a run stopped by an outer timeout keeps what it finished.
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
  every daemon alike, not by whichever daemon had no start-up probe to pay them; every arm likewise
  runs each larger B once untimed (8 tokens) before its repeats, so a process that meets a batch
  size's shapes for the first time compiles their kernels there, not in a timed run (on a GPU a
  first run at a new B took several times the others);
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
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

from scheduler.affinity import running_on
from scheduler.bench.arms import (
    HTTP_ARMS,
    RUN_BURST_KEYS,
    burst_counts,
    daemon_arms,
    daemon_bursts,
    failing_arm,
    free_port,
    memory_gib,
    open_http,
    random_prompts,
    run_daemon,
    run_engine,
    run_http,
    run_raw,
    served_model,
    step_counters,
    text_prompts,
    wait_idle,
)
from scheduler.bench.batched import Setup
from scheduler.bench.daemon_meta import read_daemons
from scheduler.bench.output import BenchError, progress
from scheduler.bench.poisson import run_poisson, write_poisson
from scheduler.bench.prefix import run_prefix
from scheduler.bench.reference import known_bandwidth
from scheduler.bench.rewrite import rewrite_prompts
from scheduler.bench.run_meta import run_meta
from scheduler.bench.spreads import rotated
from scheduler.bench.startup import ready_line, restart, second_start_text, startup_line, startup_meta, wait_idle_timed
from scheduler.bench.tables import write_b1_table, write_tables
from scheduler.cli.demo import DEMO_PROMPTS


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
    from workers.api import EngineSettings
    from workers.engine.engine import Engine
    from workers.engine.startup import buffer_cache_limit
    from workers.kernels import fastpath, qmv_launch
    from workers.kernels.backend import backend_fingerprint, configure_attention
    from workers.models.loading import load

    if getattr(args, "prefix_scenario", False):
        return run_prefix(args)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    via_http = getattr(args, "via", "zeromq") == "http"
    if via_http and importlib.util.find_spec("httpx") is None:
        # Said before the model loads: the HTTP arms' client is not one of the daemon's dependencies.
        raise BenchError("--via http needs httpx, the HTTP arms' client: pip install httpx")
    progress(f"bench: loading {args.model}")
    # One model for the in-process arms: the raw arm runs it with the project's patches lifted.
    loaded = load(args.model)
    path = Path(loaded.info.path)
    model = loaded.model
    eos = list(loaded.info.eos_token_ids)
    max_batch = max(32, *batches)  # the daemons' and the engine's, so that no B queues
    # The raw and engine arms run under the daemon's buffer-cache limit: like for like, and a bench
    # process whose cache grew to the device's size would leave the daemon arm none.
    cache_limit = buffer_cache_limit(EngineSettings())
    mx.set_cache_limit(cache_limit)
    cudnn_attention = configure_attention(EngineSettings().cudnn_attention)  # as the daemons' engines
    engine = Engine(
        model,
        eos_token_ids=loaded.info.eos_token_ids,
        vocab_size=loaded.info.vocab_size,
        max_batch=max_batch,
    )
    weight_bytes = sum(v.nbytes for _, v in cast(list[tuple[str, Any]], tree_flatten(model.parameters())))
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])

    def prompts_for(b: int, seed: int) -> list[list[int]]:
        """The workload's prompts (``--prompts``): random token ids, the demo's file-like openings, or the
        rewrite/copy chats rendered with the model's chat template."""
        if args.prompts == "demo":
            return text_prompts(loaded.tokenizer, DEMO_PROMPTS, b, seed)
        if args.prompts == "rewrite":
            return rewrite_prompts(loaded.tokenizer, b, seed)
        return random_prompts(b, args.prompt_tokens, vocab, seed)

    # The prompts' mean length (text prompts have their own), found before any daemon starts, so
    # that a prompt set the model cannot render is refused first.
    sample = prompts_for(4, seed=0)
    prompt_tokens = round(sum(len(p) for p in sample) / len(sample))
    tmp = Path(tempfile.mkdtemp(prefix="mlx-batchd-bench-"))
    drafters = [d for d in (args.drafters or "").split(",") if d]
    samples: dict[tuple[str, int], list[float]] = {}
    runs: list[dict[str, Any]] = []
    poisson: dict[str, Any] | None = None
    daemon_args: list[str] = list(getattr(args, "daemon_args", None) or [])
    cap = ["--max-tokens-cap", str(args.tokens), "--max-batch", str(max_batch), *daemon_args]
    http_url = f"http://127.0.0.1:{free_port()}" if via_http else None
    # The HTTP arms measure the daemon arm's own daemon: one process, one engine, two doors.
    http_flags = ["--http", http_url.removeprefix("http://")] if http_url else []
    arms = daemon_arms(args, cap, http_flags, drafters)
    daemons, daemon_env, env_arms, b1_arms = arms.serve, arms.env, arms.env_arms, arms.b1_arms
    device_name = backend_fingerprint()["device_name"]
    given = getattr(args, "bandwidth_gbs", None) or None
    gb_per_s = given or known_bandwidth(device_name)
    bandwidth_source = (
        "--bandwidth-gbs" if given else f"the vendor's peak for {device_name}" if gb_per_s is not None else None
    )
    setup = Setup(
        batches=tuple(batches),
        arms=(
            "raw",
            "engine",
            "daemon",
            *(("daemon_process_pin",) if args.process_pin else ()),
            *(a.name for a in env_arms),
            *(HTTP_ARMS if via_http else ()),
        ),
        b1_arms=tuple(b1_arms),
        env_arms=tuple(a.name for a in env_arms),
        repeats=args.repeats,
        min_seconds=args.min_seconds,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=loaded.info.kv_bytes_per_token,
        context=prompt_tokens + args.tokens // 2,  # the mean context over a sequence's decode
        gb_per_s=gb_per_s,
        raw_max_batch=getattr(args, "raw_max_batch", None),
    )
    machine = {
        "model_path": str(path),
        "device": str(mx.default_device()),
        "mlx": str(getattr(mx, "__version__", "unknown")),
        "row_kernel": qmv_launch.variant(),
        "mlx_cache_limit_bytes": cache_limit,
        "cudnn_attention": cudnn_attention,
        "via": "http" if via_http else "zeromq",
        "http_url": http_url,
        "bandwidth_source": bandwidth_source,
        "device_name": device_name,
        "fastpath": fastpath.active().name,
    }
    meta = run_meta(args, setup, machine, env_arms, daemon_args, drafters, prompt_tokens)
    out = Path(args.out)
    counts: dict[str, dict[str, float]] | None = None
    gates: dict[str, dict[str, Any]] = {}
    verdicts: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        progress(f"bench: starting {len(daemons)} daemon(s): {', '.join(daemons)}")
        procs: dict[str, DaemonProcess] = {}
        clients: dict[str, Client] = {}
        idle: dict[str, float] = {}
        for i, (name, extra) in enumerate(daemons.items()):
            # One at a time, each idle (start-up probe and work done) before the next is spawned: every
            # start-up figure is that daemon's alone, and nothing is timed while a daemon still starts.
            address = f"ipc://{tmp / f'{i}.sock'}"
            procs[name] = stack.enter_context(DaemonProcess(args.model, address, *extra, env=daemon_env.get(name)))
            ready_line(name, procs[name])
            clients[name] = stack.enter_context(Client(procs[name].address, timeout=3600))
            idle[name] = wait_idle_timed(name, procs[name], clients[name])
        meta["startup"] = startup_meta(procs, idle)
        http = stack.enter_context(open_http(http_url)) if http_url else None
        model_id = served_model(http) if http else ""
        probe_seconds, in_process_cpus = read_daemons(clients, engine, meta, verdicts)

        def run(arm: str, prompts: list[list[int]], tokens: int) -> tuple[int, float]:
            with failing_arm(arm):
                return run_arm(arm, prompts, tokens)

        def run_arm(arm: str, prompts: list[list[int]], tokens: int) -> tuple[int, float]:
            if arm == "raw":
                with running_on(in_process_cpus):
                    return run_raw(model, eos, prompts, tokens)
            if arm == "engine":
                with running_on(in_process_cpus):
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
        warm = prompts_for(2, seed=99)
        for arm in setup.arms:
            run(arm, warm, min(8, args.tokens))  # the daemons refuse more than --tokens
        if 1 in batches:
            # The measured shape, once, in every B = 1 arm (see the module's docstring).
            shape = prompts_for(1, seed=98)
            for arm in setup.arms_at(1):
                wait_idle(clients)
                run(arm, shape, args.tokens)
                mx.clear_cache()
        before = {name: burst_counts(daemon_bursts(clients[name])) for name in b1_arms}

        def b1_state() -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
            """Each drafter arm's burst counters since B = 1's timed runs began, and its daemon's
            burst stats (what its gate read when it last paused, how its rounds timed each way)."""
            gates = {name: daemon_bursts(clients[name]) for name in b1_arms}
            counts = {
                name: {k: v - before[name].get(k, 0) for k, v in burst_counts(gates[name]).items()} for name in b1_arms
            }
            return counts, gates

        total = args.repeats * sum(len(setup.arms_at(b)) for b in batches)
        seconds: dict[tuple[str, int], float] = {}  # each arm's timed seconds at each B (--min-seconds)
        done = 0
        for b in batches:
            if b != 1:  # B = 1 ran its measured shape above
                # This batch size's shapes, once, in every arm (see the module's docstring).
                wave = prompts_for(b, seed=1000 * b + 999)
                progress(f"bench: B = {b}, warming every arm up (untimed)")
                for arm in setup.arms_at(b):
                    wait_idle(clients)
                    run(arm, wave, min(8, args.tokens))
                    mx.clear_cache()
            rep = 0
            while setup.wants_repeat(seconds, b, rep):
                if rep >= args.repeats:  # a repeat --min-seconds added
                    total += len(setup.arms_at(b))
                prompts = prompts_for(b, seed=1000 * b + rep)
                for position, arm in enumerate(rotated(setup.arms_at(b), rep)):
                    wait_idle(clients)
                    before_steps = counters(arm)
                    before_bursts = burst_counts(daemon_bursts(clients[arm])) if arm in b1_arms else None
                    started_at = time.time()
                    n, wall = run(arm, prompts, args.tokens)
                    after_steps = counters(arm)
                    after_bursts = burst_counts(daemon_bursts(clients[arm])) if arm in b1_arms else None
                    samples.setdefault((arm, b), []).append(n / wall)
                    seconds[(arm, b)] = seconds.get((arm, b), 0.0) + wall
                    runs.append(
                        {
                            "batch": b,
                            "repeat": rep,
                            "position": position,
                            # Wall-clock start (Unix seconds): to line a run up with a log of the GPU's
                            # clocks (the device scripts' gpu.csv).
                            "started_at": started_at,
                            "arm": arm,
                            "tokens": n,
                            "seconds": wall,
                            # This process's MLX memory (raw and engine arms run here), for a run
                            # that ends out of memory on a shared GPU.
                            "bench_process_gib": memory_gib(),
                            # How the engine spent the run (steps, decode steps, their seconds): a
                            # daemon slower than the engine alone shows here as more or slower steps.
                            "engine_steps": None
                            if before_steps is None or after_steps is None
                            else {k: after_steps[k] - before_steps[k] for k in after_steps},
                            # A drafter arm's rounds in this run and their seconds: one slow round
                            # (a kernel compiled mid-run, say) shows in the run it slowed.
                            "bursts": None
                            if before_bursts is None or after_bursts is None
                            else {k: after_bursts[k] - before_bursts[k] for k in RUN_BURST_KEYS},
                        }
                    )
                    mx.clear_cache()  # MLX keeps freed buffers; on one GPU the daemons need that memory
                    done += 1
                    rounds = runs[-1]["bursts"]
                    progress(
                        f"bench [{done}/{total}] B = {b}, repeat {rep + 1}/{max(rep + 1, args.repeats)}, {arm}: "
                        f"{n} tokens in {wall:.3f} s = {n / wall:.1f} tok/s"
                        + ("" if rounds is None else f", {rounds['rounds']:.0f} burst rounds")
                    )
                rep += 1
                if b == 1 and b1_arms and setup.wants_repeat(seconds, b, rep):
                    # The burst table so far, so that a run an outer timeout stops keeps its B = 1 rows.
                    counts, gates = b1_state()
                    write_b1_table(samples, setup, {**meta, "repeats_done": rep}, out, counts, verdicts, runs, gates)
            if b == 1 and b1_arms:
                counts, gates = b1_state()
            write_tables(samples, setup, meta, out, counts, verdicts, runs, gates)
            progress(f"bench: B = {b} done, tables for B = {setup.finished(samples)} in {out}")
        if args.poisson_rate > 0:
            # The production shape: the first drafter's daemon (bursts whenever one request is alone).
            target = b1_arms[0] if b1_arms else "daemon"
            progress(f"bench: {args.poisson_requests} Poisson arrivals at {args.poisson_rate:g}/s on '{target}'")
            wait_idle(clients)
            poisson = run_poisson(
                procs[target].address,
                args.poisson_rate,
                args.poisson_requests,
                vocab,
                args.tokens,
                fixed_tokens=getattr(args, "poisson_tokens", None),
            )
            poisson["daemon"] = target
            write_poisson(poisson, meta, out)
    # Every daemon got SIGTERM when the stack closed; anything but 0 is a shutdown bug worth seeing.
    exit_codes = {name: proc.proc.returncode for name, proc in procs.items()}
    for name, code in exit_codes.items():
        if code != 0:
            print(f"warning: the '{name}' daemon exited with {code} after SIGTERM", file=sys.stderr)
    meta["daemon_exit_codes"] = exit_codes
    if getattr(args, "restart_times", False):
        # The daemon arm's second start on this machine, alone: what a restarted server pays.
        progress("bench: starting the 'daemon' daemon again (--restart-times)")
        mx.clear_cache()
        again = restart(
            args.model,
            f"ipc://{tmp / 'restart.sock'}",
            daemons["daemon"],
            daemon_env.get("daemon"),
            prompts_for(1, seed=97)[0],
            min(8, args.tokens),
        )
        meta["restart"] = {"daemon": "daemon", **again}
        progress(f"bench: {second_start_text(again)} after its spawn")
    print(write_tables(samples, setup, meta, out, counts, verdicts, runs, gates))
    if poisson is not None:
        print(f"Poisson arrivals on the '{poisson['daemon']}' daemon:")
        print(write_poisson(poisson, meta, out))
    if probe_seconds:
        print("probe time: " + ", ".join(f"{k}: {v:.2f}s" for k, v in probe_seconds.items()))
    print(startup_line(meta))
    print(f"results in {out.resolve()}", flush=True)
    return 0
