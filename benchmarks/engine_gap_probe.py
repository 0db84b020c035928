"""Device measurement: where the daemon's engine loses step time against the engine alone.

    python benchmarks/engine_gap_probe.py --model "$M" --out gap.json

``mlx-batchd bench`` showed the daemon's engine taking the same number of decode steps as the
engine alone, each slower (H200, 8B synth, B = 64: 52-58 ms against 40 ms). The same decode
workload runs here under each way of hosting the engine, alternating, and the engine's own
counters give milliseconds per decode step:

- ``main``: ``Engine.step`` in a loop on the main thread (the bench's engine arm);
- ``main~G``: the same, with G prompts submitted per step (arrivals spread over steps, as a daemon's
  clients arrive, against all at once);
- ``main-warm``: ``main`` after a 2-token run of the same prompts (untimed): every arm starts after
  ``mx.clear_cache()``, as a daemon's engine does after each idle tick (``EngineThread._release_cache``),
  so ``main`` against ``main-warm`` is what re-allocating the step's buffers costs a request;
- ``thread``: the same loop on a second thread;
- ``loop``: ``EngineThread`` (the daemon's engine loop) in this process, events dropped;
- ``process``: ``EngineProcess`` (the daemon's default: the engine loop in a child process, events
  over ipc), events received and dropped;
- ``daemon``: a real ``mlx-batchd serve`` driven as the bench drives it (one client, a thread per
  sequence), counters from its ``stats``;
- ``daemon-1client``: the same daemon, all sequences from one thread with the async client (no
  thread per sequence), to separate the clients' cost from the front end's;
- ``daemon@W``: a daemon started with ``--admit-window-ms W`` (``workers/engine/arrivals.py``), driven as
  ``daemon``; several windows side by side say what holding arrivals for a prefill wave buys.
  ``daemon@W/I`` adds ``--admit-idle-window-ms I`` (arrivals that find the engine idle).

Each arm also reports its wall-clock tokens per second (all sequences' tokens over the time from
the first submit to the last token), which counts prefill and admission as well as decode steps.

``--profile-dir DIR`` adds ``cProfile`` of the main arm's steps and of the daemon's engine thread
(``workers/engine/profiling.py``), to set side by side.

On the H200 (8B synth) the first four agreed within ~4 % (B = 64) while the bench's daemon arm
took 25-40 % longer per step; the last two say whether the front end or the client side costs it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx

from scheduler.engine_process import EngineProcess
from workers.api import EngineSettings, Finished, Job, Ready
from workers.engine import profiling
from workers.engine.engine import Engine
from workers.engine.loop import EngineThread
from workers.models.loading import load


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(32)] for _ in range(n)]


def drive_engine(engine: Engine, ps: list[list[int]], tokens: int, group: int = 0) -> tuple[int, float, int]:
    """Submit every prompt, then step until all end; ``group`` > 0 submits that many per step instead
    (arrivals spread over steps, as a daemon's clients arrive)."""
    c = engine.counters
    before = (c.decode_steps, c.decode_seconds, c.prefill_steps)
    group = group or len(ps)
    for start in range(0, len(ps), group):
        for i in range(start, min(start + group, len(ps))):
            engine.submit(Job(seq=i, prompt=ps[i], max_tokens=tokens))
        if start + group < len(ps):
            engine.step()
    while engine.has_work:
        engine.step()
    c = engine.counters
    return _delta((c.decode_steps, c.decode_seconds, c.prefill_steps), before)


def on_thread(engine: Engine, ps: list[list[int]], tokens: int) -> tuple[int, float, int]:
    out: list[tuple[int, float, int]] = []
    t = threading.Thread(target=lambda: out.append(drive_engine(engine, ps, tokens)))
    t.start()
    t.join()
    return out[0]


def _counters(snap: Any) -> tuple[int, float, int]:
    """Decode steps, their seconds and prefill steps from an engine snapshot."""
    return int(snap.get("decode_steps", 0)), float(snap.get("decode_seconds", 0.0)), int(snap.get("prefill_steps", 0))


def _delta(after: tuple[int, float, int], before: tuple[int, float, int]) -> tuple[int, float, int]:
    return after[0] - before[0], after[1] - before[1], after[2] - before[2]


class Hosted:
    """An ``EngineThread`` or ``EngineProcess``: submit, wait for every ``Finished``, read counters."""

    def __init__(self, kind: str, model: str, load_fn: Any) -> None:
        self.ready = threading.Event()
        self.done = threading.Semaphore(0)
        settings = EngineSettings(max_batch=128)
        if kind == "loop":
            self.handle: Any = EngineThread(load_fn, self.emit, settings)
        else:
            self.handle = EngineProcess(model, None, self.emit, settings)
        self.handle.start()
        if not self.ready.wait(600):
            raise RuntimeError(f"{kind}: no ready")
        self.seq = 0
        self.wall = 0.0

    def emit(self, signals: list[Any]) -> None:
        for s in signals:
            if isinstance(s, Ready):
                self.ready.set()
            elif isinstance(s, Finished):
                self.done.release()

    def counters(self) -> tuple[int, float, int]:
        return _counters(self.handle.snapshot())

    def run(self, ps: list[list[int]], tokens: int) -> tuple[int, float, int]:
        """Decode steps and their seconds; ``self.wall`` is the time from the first submit to the
        last end (the pauses around it, for the counters, are not in it)."""
        time.sleep(0.3)  # the process's snapshot is pushed at most every 0.1 s while idle
        before = self.counters()
        tic = time.perf_counter()
        for p in ps:
            self.handle.submit(Job(seq=self.seq, prompt=p, max_tokens=tokens))
            self.seq += 1
        for _ in ps:
            self.done.acquire()
        self.wall = time.perf_counter() - tic
        time.sleep(0.3)
        after = self.counters()
        return _delta(after, before)

    def close(self) -> None:
        self.handle.shutdown()
        self.handle.join(30)


class Served:
    """A real daemon and a client, as ``mlx-batchd bench``'s daemon arm runs them."""

    def __init__(self, model: str, *args: str) -> None:
        from clients.sync import Client
        from scheduler.spawn import DaemonProcess

        folder = Path(tempfile.mkdtemp(prefix="mlx-batchd-gap-"))
        address = f"ipc://{folder / 'd.sock'}"
        self.proc = DaemonProcess(model, address, "--max-batch", "128", "--max-tokens-cap", "4096", *args)
        self.proc.wait_ready()
        self.client = Client(self.proc.address, timeout=3600)

    def counters(self) -> tuple[int, float, int]:
        return _counters(self.client.stats()["engine"])

    def run(self, ps: list[list[int]], tokens: int, threads: bool) -> tuple[int, float, int]:
        before = self.counters()
        if threads:
            with ThreadPoolExecutor(len(ps)) as pool:
                list(pool.map(lambda p: self.client.generate(tokens=p, max_tokens=tokens), ps))
        else:
            import anyio

            from clients.client import AsyncClient

            async def all_at_once() -> None:
                async with AsyncClient(self.proc.address) as c, anyio.create_task_group() as tg:
                    for p in ps:
                        tg.start_soon(lambda p=p: c.generate(tokens=p, max_tokens=tokens))

            anyio.run(all_at_once)
        after = self.counters()
        return _delta(after, before)

    def close(self) -> None:
        self.client.close()
        self.proc.stop()


def daemon_args(windows: str) -> list[str]:
    """``W`` or ``W/I`` (an arm's text after ``daemon@``) as the daemon's admission options."""
    busy, _, idle = windows.partition("/")
    return [*(("--admit-window-ms", busy) if busy else ()), *(("--admit-idle-window-ms", idle) if idle else ())]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default="main,thread,loop,process,daemon,daemon-1client")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--profile-dir", help="profile the main arm here, and the daemon's engine thread (MLX_BATCHD_PROFILE_DIR)"
    )
    a = ap.parse_args()
    main_profile = cProfile.Profile() if a.profile_dir else None
    loaded = load(a.model)
    vocab = loaded.info.vocab_size
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=vocab, max_batch=128)
    arms = a.arms.split(",")
    hosted = {k: Hosted(k, a.model, lambda: loaded) for k in arms if k in ("loop", "process")}
    if a.profile_dir:
        os.environ[profiling.ENV] = a.profile_dir  # read by the daemon's engine process only: it starts next
    windows = sorted({k.partition("@")[2] for k in arms if k.startswith("daemon")})
    served = {w: Served(a.model, *daemon_args(w)) for w in windows}
    results: dict[str, dict[str, list[float]]] = {}
    rates: dict[str, dict[str, list[float]]] = {}
    for b in [int(x) for x in a.batches.split(",")]:
        for rep in range(a.repeats + 1):  # repeat 0 warms every arm up
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
            for arm in order:
                ps = prompts(b, vocab, 1000 * b + rep)
                t0 = time.perf_counter()
                if arm == "main":
                    if main_profile is not None:
                        main_profile.enable()
                    steps, secs, prefills = drive_engine(engine, ps, a.tokens)
                    if main_profile is not None:
                        main_profile.disable()
                elif arm == "main-warm":
                    drive_engine(engine, ps, 2)
                    t0 = time.perf_counter()
                    steps, secs, prefills = drive_engine(engine, ps, a.tokens)
                elif arm.startswith("main~"):
                    steps, secs, prefills = drive_engine(engine, ps, a.tokens, group=int(arm.partition("~")[2]))
                elif arm == "thread":
                    steps, secs, prefills = on_thread(engine, ps, a.tokens)
                elif arm.startswith("daemon"):
                    window = arm.partition("@")[2]
                    steps, secs, prefills = served[window].run(ps, a.tokens, threads=arm != "daemon-1client")
                else:
                    steps, secs, prefills = hosted[arm].run(ps, a.tokens)
                wall = hosted[arm].wall if arm in hosted else time.perf_counter() - t0
                tok_s = b * a.tokens / wall
                mx.clear_cache()
                ms = 1e3 * secs / max(steps, 1)
                print(
                    f"B={b} rep={rep} {arm}: {steps} decode steps, {ms:.2f} ms/step, {prefills} prefill steps, {tok_s:.1f} tok/s",
                    flush=True,
                )
                if rep:
                    results.setdefault(f"B={b}", {}).setdefault(arm, []).append(ms)
                    rates.setdefault(f"B={b}", {}).setdefault(arm, []).append(tok_s)
    for h in hosted.values():
        h.close()
    for d in served.values():
        d.close()
    if main_profile is not None:
        profiling.write(main_profile, Path(a.profile_dir) / f"main-{os.getpid()}")
    summary = {
        b: {
            arm: {
                "median_ms": statistics.median(v),
                "min": min(v),
                "max": max(v),
                "median_tok_s": statistics.median(rates[b][arm]),
                "tok_s_min": min(rates[b][arm]),
                "tok_s_max": max(rates[b][arm]),
            }
            for arm, v in arms_.items()
        }
        for b, arms_ in results.items()
    }
    print(json.dumps(summary, indent=1))
    with open(a.out, "w") as f:
        json.dump({"samples": results, "tok_s": rates, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
