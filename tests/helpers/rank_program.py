"""The rank program the distributed tests start: ``python -m tests.helpers.rank_program SCENARIO SPEC``.

The tests run it under ``mlx.launch --backend ring -n 2`` as a user would, or, where a test needs each
rank's own exit status, with the same environment ``mlx.launch`` sets (``MLX_RANK``, ``MLX_HOSTFILE``),
or alone as the single-process reference. ``SPEC`` is a JSON file naming the model(s) and the folder
``out``; every rank writes what it saw to ``OUT/rank{N}.json`` and the tests compare those files.
It imports no pytest: it is a program of its own, not a test module.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: Seconds a whole 2-rank run may take on a loaded 2-core machine before the test fails (never hangs).
RUN_TIMEOUT = 240
#: A serve loop's ranks apply a plan every ~0.05 s; this long without one, a rank stops (``_serve``).
SERVE_WATCH_S = 20.0
MAX_TOKENS = 24
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200, 31, 64], [72, 101, 108, 108, 111, 44, 32], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def _write(out: Path, rank: int, result: dict[str, Any]) -> None:
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(out / f"rank{rank}.json")


def _load(spec: dict[str, Any], world: Any) -> tuple[Any, Any]:
    """Load the model (lazily, as a sharded engine would), check the ranks agree, shard it."""
    from mlx_lm import load

    from workers.dist import checkpoint_fingerprint, prepare

    path = spec["models"][world.rank] if "models" in spec else spec["model"]
    model, _, config = load(path, lazy=True, return_config=True)  # type: ignore[misc]
    return model, prepare(model, world, config, checkpoint_fingerprint(path), spec.get("mode", "auto"))


ODD_VALUES: list[Any] = [
    None,
    0,
    2**63 - 1,
    -1.5,
    "naïve ✓",
    b"\x00\xff" * 700,
    {"nested": {"ids": list(range(600))}, 7: [True, False, None]},
]


def _greedy(spec: dict[str, Any], world: Any, out: Path) -> dict[str, Any]:
    """Prompts reach the followers only through ``Lockstep``; every rank decodes them greedily."""
    import hashlib

    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    from workers.api import Cancel, Command, Job, Pause, Resume, SamplingParams, SubmitJob
    from workers.dist import Broadcaster, Lockstep

    model, report = _load(spec, world)
    broadcast = Broadcaster(world)
    odd = [broadcast(v if world.leader else None) for v in ODD_VALUES]
    lockstep = Lockstep(world)
    plans: list[Any] = []
    tokens: list[list[int]] = []
    rows: list[Any] = []
    digest = hashlib.sha256()
    queue = list(spec["prompts"]) if world.leader else []
    while True:
        if world.leader:
            commands: list[Command] = (
                [SubmitJob(Job(seq=len(tokens), prompt=queue.pop(0), max_tokens=spec["max_tokens"], received_at=0.0))]
                if queue
                else []
            )
            plan = lockstep.publish(commands, {"action": "decode" if commands else "stop"}, stop=not commands)
        else:
            plan = lockstep.receive()
        plans.append(plan.to_wire())
        if plan.stop:
            break
        submit = plan.commands[0]
        assert isinstance(submit, SubmitJob)
        job = submit.job
        got: list[int] = []
        for token, logprobs in generate_step(mx.array(job.prompt), model, max_tokens=job.max_tokens):
            got.append(int(token))
            row = np.array(logprobs.astype(mx.float32))
            digest.update(row.tobytes())
            rows.append(row)
        tokens.append(got)
    # A plan past the inline size takes a second collective: a long prompt and every command kind.
    big: list[Command] = [
        SubmitJob(
            Job(seq=9, prompt=list(range(3000)), max_tokens=1, sampling=SamplingParams(seed=2**62 + 1), received_at=0.0)
        ),
        Cancel(3, "cancelled", None, None),
        Pause(4),
        Resume(4),
    ]
    if world.leader:
        plans.append(lockstep.publish(big, {"burst": False, "probe": True}, wait_s=0.01).to_wire())
        plans.append(lockstep.publish(stop=True).to_wire())
    else:
        plans.append(lockstep.receive().to_wire())
        plans.append(lockstep.receive().to_wire())
    if world.leader:
        np.save(out / "logprobs.npy", np.stack(rows))
    return {
        "mode": report.mode,
        "fingerprint": report.fingerprint,
        "tokens": tokens,
        "logprobs_sha256": digest.hexdigest(),
        "plans": plans,
        "odd": [repr(v) for v in odd],
    }


def _engine(spec: dict[str, Any], world: Any, out: Path) -> dict[str, Any]:
    """The daemon's ``Engine`` (``BatchGenerator``, its look-ahead step) driven by plans: requests
    arrive at rank 0 only, on different iterations, one is cancelled mid-decode; every rank applies
    the same commands and steps the same iterations."""
    from workers.api import Cancel, Command, Job, SamplingParams, SubmitJob, Tokens
    from workers.dist import Lockstep
    from workers.engine.engine import Engine

    model, report = _load(spec, world)
    engine = Engine(model, eos_token_ids=(0,), vocab_size=spec["vocab"], max_batch=8)
    lockstep = Lockstep(world)
    arrivals = {0: [PROMPTS[0]], 3: [PROMPTS[1]], 7: [PROMPTS[2], PROMPTS[0][:4]]}
    tokens: dict[str, list[int]] = {}
    seq = iteration = 0
    while True:
        if world.leader:
            commands: list[Command] = []
            for prompt in arrivals.get(iteration, []):
                sampling = SamplingParams(temperature=0.8, seed=1000 + seq) if seq % 2 else SamplingParams()
                job = Job(seq=seq, prompt=prompt, max_tokens=MAX_TOKENS, sampling=sampling)
                commands.append(SubmitJob(job))
                seq += 1
            if iteration == 10:
                commands.append(Cancel(1, "cancelled", None, None))
            step = engine.has_work or bool(commands)
            plan = lockstep.publish(commands, {"step": step}, stop=iteration > max(arrivals) and not step)
        else:
            plan = lockstep.receive()
        if plan.stop:
            break
        for c in plan.commands:
            if isinstance(c, SubmitJob):
                engine.submit(c.job)
            elif isinstance(c, Cancel):
                engine.cancel(c.seq)
        if plan.decisions["step"]:
            for event in engine.step():
                if isinstance(event, Tokens):
                    tokens.setdefault(str(event.seq), []).extend(event.tokens)
        iteration += 1
    return {"mode": report.mode, "tokens": tokens, "iterations": iteration}


def _serve(spec: dict[str, Any], world: Any, out: Path) -> dict[str, Any]:
    """A serve-shaped loop: rank 0 publishes idle ticks, every rank runs a sharded forward on each
    plan, until rank 0 is told to stop (SIGTERM) or a peer dies."""
    import mlx.core as mx

    from workers.dist import Lockstep

    model, _ = _load(spec, world)
    lockstep = Lockstep(world)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    last = [time.monotonic()]

    def forward(_plan: Any = None) -> None:
        mx.eval(model(mx.array([[1, 2, 3]])))
        last[0] = time.monotonic()

    def watch() -> None:
        """As the daemon's rank watchdog (``EngineThread._watch``): MLX's ring can wait for good in a
        collective whose peer died mid-transfer (seen once in about ten CI runs, rank 0 SIGKILLed),
        and a serve loop must end on its own all the same."""
        while True:
            time.sleep(1.0)
            if time.monotonic() - last[0] > SERVE_WATCH_S:
                why = f"rank {world.rank}: no plan applied for {SERVE_WATCH_S:g} s; a peer is gone"
                print(f"mlx-batchd: {why}", file=sys.stderr, flush=True)
                _write(out, world.rank, {"error": why, "kind": "RankTimeout"})
                os._exit(1)

    forward()
    _write(out, world.rank, {"ready": True, "pid": os.getpid()})
    threading.Thread(target=watch, daemon=True).start()
    applied = 0
    if world.leader:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not stopping and time.monotonic() < deadline:
            lockstep.publish(decisions={"action": "forward"}, wait_s=0.05)
            forward()
            applied += 1
            time.sleep(0.05)
        lockstep.publish(stop=True)
    else:
        applied = lockstep.follow(forward)
    return {"applied": applied, "stopped_by": "sigterm" if stopping else "stop"}


def _load_only(spec: dict[str, Any], world: Any, out: Path) -> dict[str, Any]:
    return {"mode": _load(spec, world)[1].mode}


def rank_main(scenario: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    if scenario == "ping":  # only mlx itself: a skip must say the machine cannot, not that this module is broken
        import mlx.core as mx

        group = mx.distributed.init(strict=True, backend="ring")
        total = mx.distributed.all_sum(mx.array([group.rank() + 1]), group=group)
        _write(out, group.rank(), {"size": group.size(), "sum": total.item()})
        return 0

    from workers.dist import JOIN_TIMEOUT_S, World

    world = World.from_env(timeout_s=spec.get("join_timeout", JOIN_TIMEOUT_S))
    try:
        scenarios = {"greedy": _greedy, "engine": _engine, "serve": _serve, "load": _load_only}
        result = scenarios[scenario](spec, world, out)
    except Exception as exc:  # one line, as the daemon would print it
        print(f"mlx-batchd: {exc}", file=sys.stderr)
        _write(out, world.rank, {"error": str(exc), "kind": type(exc).__name__})
        return 3
    _write(out, world.rank, {"world": world.describe(), **result})
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], sys.argv[2]))
