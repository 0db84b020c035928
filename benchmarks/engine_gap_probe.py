"""Device measurement: where the daemon's engine loses step time against the engine alone.

    python benchmarks/engine_gap_probe.py --model /tmp/m8b --out gap.json

``mlx-batchd bench`` showed the daemon's engine taking the same number of decode steps as the
engine alone, each slower (H200, 8B synth, B = 64: 52-58 ms against 40 ms). The same decode
workload runs here under each way of hosting the engine, alternating, and the engine's own
counters give milliseconds per decode step:

- ``main``: ``Engine.step`` in a loop on the main thread (the bench's engine arm);
- ``thread``: the same loop on a second thread;
- ``loop``: ``EngineThread`` (the daemon's engine loop) in this process, events dropped;
- ``process``: ``EngineProcess`` (the daemon's default: the engine loop in a child process, events
  over ipc), events received and dropped.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from typing import Any

import mlx.core as mx

from scheduler.engine_process import EngineProcess
from workers.engine import Engine
from workers.jobs import Finished, Job
from workers.loop import EngineSettings, EngineThread, Ready
from workers.models import load


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(32)] for _ in range(n)]


def drive_engine(engine: Engine, ps: list[list[int]], tokens: int) -> tuple[int, float]:
    before = (engine.counters.decode_steps, engine.counters.decode_seconds)
    for i, p in enumerate(ps):
        engine.submit(Job(seq=i, prompt=p, max_tokens=tokens))
    while engine.has_work:
        engine.step()
    return engine.counters.decode_steps - before[0], engine.counters.decode_seconds - before[1]


def on_thread(engine: Engine, ps: list[list[int]], tokens: int) -> tuple[int, float]:
    out: list[tuple[int, float]] = []
    t = threading.Thread(target=lambda: out.append(drive_engine(engine, ps, tokens)))
    t.start()
    t.join()
    return out[0]


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

    def emit(self, signals: list[Any]) -> None:
        for s in signals:
            if isinstance(s, Ready):
                self.ready.set()
            elif isinstance(s, Finished):
                self.done.release()

    def counters(self) -> tuple[int, float]:
        snap = self.handle.snapshot()
        return int(snap.get("decode_steps", 0)), float(snap.get("decode_seconds", 0.0))

    def run(self, ps: list[list[int]], tokens: int) -> tuple[int, float]:
        time.sleep(0.3)  # the process's snapshot is pushed at most every 0.1 s while idle
        before = self.counters()
        for p in ps:
            self.handle.submit(Job(seq=self.seq, prompt=p, max_tokens=tokens))
            self.seq += 1
        for _ in ps:
            self.done.acquire()
        time.sleep(0.3)
        after = self.counters()
        return after[0] - before[0], after[1] - before[1]

    def close(self) -> None:
        self.handle.shutdown()
        self.handle.join(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default="main,thread,loop,process")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    loaded = load(a.model)
    vocab = loaded.info.vocab_size
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=vocab, max_batch=128)
    arms = a.arms.split(",")
    hosted = {k: Hosted(k, a.model, lambda: loaded) for k in arms if k in ("loop", "process")}
    results: dict[str, dict[str, list[float]]] = {}
    for b in [int(x) for x in a.batches.split(",")]:
        for rep in range(a.repeats + 1):  # repeat 0 warms every arm up
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
            for arm in order:
                ps = prompts(b, vocab, 1000 * b + rep)
                if arm == "main":
                    steps, secs = drive_engine(engine, ps, a.tokens)
                elif arm == "thread":
                    steps, secs = on_thread(engine, ps, a.tokens)
                else:
                    steps, secs = hosted[arm].run(ps, a.tokens)
                mx.clear_cache()
                ms = 1e3 * secs / max(steps, 1)
                print(f"B={b} rep={rep} {arm}: {steps} decode steps, {ms:.2f} ms/step", flush=True)
                if rep:
                    results.setdefault(f"B={b}", {}).setdefault(arm, []).append(ms)
    for h in hosted.values():
        h.close()
    summary = {
        b: {arm: {"median_ms": statistics.median(v), "min": min(v), "max": max(v)} for arm, v in arms_.items()}
        for b, arms_ in results.items()
    }
    print(json.dumps(summary, indent=1))
    with open(a.out, "w") as f:
        json.dump({"samples": results, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
