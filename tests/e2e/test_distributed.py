"""``workers.distributed`` on a real 2-rank ring group on this machine's CPU.

Each scenario runs this file as the rank program (``python -m tests.e2e.test_distributed SCENARIO
SPEC``), started by ``mlx.launch --backend ring -n 2`` as a user would, or, where a test needs each
rank's own exit status, by the same environment ``mlx.launch`` sets (``MLX_RANK``, ``MLX_HOSTFILE``):
``mlx.launch`` exits 0 whatever its ranks did and SIGTERMs the others as soon as one fails, which
would hide whether a survivor notices on its own. Every rank writes what it saw to
``OUT/rank{N}.json``; the tests compare those files. Every process runs under a timeout and is
killed with its whole process group, so nothing outlives a test.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.distributed import models as models

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = Path(sys.executable).parent / "mlx.launch"
#: Seconds a whole 2-rank run may take on a loaded 2-core machine before the test fails (never hangs).
RUN_TIMEOUT = 240
#: Seconds a survivor may take to exit after its peer died.
DEATH_TIMEOUT = 60
MAX_TOKENS = 24
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200, 31, 64], [72, 101, 108, 108, 111, 44, 32], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


# ----------------------------------------------------------------------------- the rank program


def _write(out: Path, rank: int, result: dict[str, Any]) -> None:
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(out / f"rank{rank}.json")


def _load(spec: dict[str, Any], world: Any) -> tuple[Any, Any]:
    """Load the model (lazily, as a sharded engine would), check the ranks agree, shard it."""
    from mlx_lm import load

    from workers.distributed import checkpoint_fingerprint, prepare

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

    from workers.distributed import Broadcaster, Lockstep

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
            commands = [{"c": "submit", "prompt": queue.pop(0), "max_tokens": spec["max_tokens"]}] if queue else []
            plan = lockstep.publish(commands, {"action": "decode" if commands else "stop"}, stop=not commands)
        else:
            plan = lockstep.receive()
        plans.append(plan.to_wire())
        if plan.stop:
            break
        job = plan.commands[0]
        got: list[int] = []
        for token, logprobs in generate_step(mx.array(job["prompt"]), model, max_tokens=job["max_tokens"]):
            got.append(int(token))
            row = np.array(logprobs.astype(mx.float32))
            digest.update(row.tobytes())
            rows.append(row)
        tokens.append(got)
    # A plan past the inline size takes a second collective: a long prompt and every command kind.
    big = [
        {"c": "submit", "prompt": list(range(3000)), "seed": 2**62 + 1},
        {"c": "cancel", "seq": 3},
        {"c": "pause", "seq": 4},
        {"c": "resume", "seq": 4},
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
    from scheduler.engine_process import job_from_wire, job_to_wire
    from workers.distributed import Lockstep
    from workers.engine import Engine, Job, Tokens
    from workers.params import SamplingParams

    model, report = _load(spec, world)
    engine = Engine(model, eos_token_ids=(0,), vocab_size=spec["vocab"], max_batch=8)
    lockstep = Lockstep(world)
    arrivals = {0: [PROMPTS[0]], 3: [PROMPTS[1]], 7: [PROMPTS[2], PROMPTS[0][:4]]}
    tokens: dict[str, list[int]] = {}
    seq = iteration = 0
    while True:
        if world.leader:
            commands: list[Any] = []
            for prompt in arrivals.get(iteration, []):
                sampling = SamplingParams(temperature=0.8, seed=1000 + seq) if seq % 2 else SamplingParams()
                job = Job(seq=seq, prompt=prompt, max_tokens=MAX_TOKENS, sampling=sampling)
                commands.append({"c": "submit", "job": job_to_wire(job)})
                seq += 1
            if iteration == 10:
                commands.append({"c": "cancel", "seq": 1})
            step = engine.has_work or bool(commands)
            plan = lockstep.publish(commands, {"step": step}, stop=iteration > max(arrivals) and not step)
        else:
            plan = lockstep.receive()
        if plan.stop:
            break
        for c in plan.commands:
            if c["c"] == "submit":
                engine.submit(job_from_wire(c["job"]))
            else:
                engine.cancel(c["seq"])
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

    from workers.distributed import Lockstep

    model, _ = _load(spec, world)
    lockstep = Lockstep(world)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))

    def forward(_plan: Any = None) -> None:
        mx.eval(model(mx.array([[1, 2, 3]])))

    forward()
    _write(out, world.rank, {"ready": True, "pid": os.getpid()})
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

    from workers.distributed import JOIN_TIMEOUT_S, World

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


# ----------------------------------------------------------------------------- launching


def _free_ports() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free now (the ring listens on one per rank)."""
    for _ in range(200):
        p = random.randrange(20000, 60000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two free consecutive ports")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _spec(tmp: Path, **spec: Any) -> tuple[Path, Path]:
    out = tmp / "out"
    out.mkdir(parents=True, exist_ok=True)
    path = tmp / "spec.json"
    path.write_text(json.dumps({"out": str(out), **spec}))
    return path, out


def _rank_command(scenario: str, spec: Path) -> list[str]:
    return [sys.executable, "-m", "tests.e2e.test_distributed", scenario, str(spec)]


def _launcher(scenario: str, tmp: Path, spec_path: Path, **io: Any) -> subprocess.Popen[bytes]:
    """``mlx.launch`` in its own process group; ``TMPDIR`` keeps the hostfiles and pidfiles it
    creates per rank with ``mktemp`` (and never removes) in the test's folder."""
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--starting-port", str(_free_ports()), "--"]
    return subprocess.Popen(
        cmd + _rank_command(scenario, spec_path),
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp)},
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        **io,
    )


def launch(scenario: str, tmp: Path, **spec: Any) -> tuple[list[dict[str, Any]], str]:
    """``mlx.launch --backend ring -n 2 -- <rank program>``: every rank's result and the output."""
    spec_path, out = _spec(tmp, **spec)
    proc = _launcher(scenario, tmp, spec_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise AssertionError(f"mlx.launch {scenario} did not finish in {RUN_TIMEOUT} s") from None
    text = output.decode(errors="replace")
    results = []
    for r in range(2):
        f = out / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote nothing:\n{text}"
        results.append(json.loads(f.read_text()))
    return results, text


def single(scenario: str, tmp: Path, **spec: Any) -> dict[str, Any]:
    """The rank program on its own (not launched): the single-process reference."""
    spec_path, out = _spec(tmp, **spec)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    done = subprocess.run(
        _rank_command(scenario, spec_path), cwd=ROOT, env=env, capture_output=True, timeout=RUN_TIMEOUT
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    result: dict[str, Any] = json.loads((out / "rank0.json").read_text())
    return result


class Ranks:
    """Two ranks started with the environment ``mlx.launch`` gives them, so each exit status is its own."""

    def __init__(self, scenario: str, tmp: Path, **spec: Any) -> None:
        spec_path, self.out = _spec(tmp, **spec)
        self.start(tmp, [_rank_command(scenario, spec_path)] * 2)

    def start(self, tmp: Path, commands: list[list[str]], envs: list[dict[str, str]] | None = None) -> None:
        port = _free_ports()
        hostfile = tmp / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
        self.logs = [(tmp / f"rank{r}.log").open("wb") for r in range(2)]
        self.procs = [
            subprocess.Popen(
                command,
                cwd=ROOT,
                env={
                    **os.environ,
                    "MLX_RANK": str(r),
                    "MLX_HOSTFILE": str(hostfile),
                    "PYTHONUNBUFFERED": "1",
                    **(envs[r] if envs else {}),
                },
                stdin=subprocess.DEVNULL,
                stdout=self.logs[r],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for r, command in enumerate(commands)
        ]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT
        while time.monotonic() < deadline:
            if all((self.out / f"rank{r}.json").exists() for r in range(2)):
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.1)
        raise AssertionError(f"the ranks did not get ready:\n{self.output()}")

    def result(self, rank: int) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.out / f"rank{rank}.json").read_text())
        return data

    def wait(self, rank: int, timeout: float) -> int:
        try:
            return self.procs[rank].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {rank} still runs {timeout} s later (hang):\n{self.output()}") from None

    def output(self) -> str:
        for f in self.logs:
            f.flush()
        return "\n".join(Path(f.name).read_text(errors="replace") for f in self.logs)

    def close(self) -> None:
        for p in self.procs:
            _kill_group(p)
        for f in self.logs:
            f.close()


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip (saying why) where ``mlx.launch`` cannot start a 2-rank ring group on this machine."""
    import mlx.core as mx

    if not LAUNCH.exists():
        pytest.skip(f"no mlx.launch next to {sys.executable}")
    if not mx.distributed.is_available("ring"):
        pytest.skip("this mlx build has no ring backend")
    try:
        results, _ = launch("ping", tmp_path_factory.mktemp("ping"))
    except AssertionError as exc:
        pytest.skip(f"mlx.launch --backend ring -n 2 cannot run here: {exc}")
    if [r.get("sum") for r in results] != [3, 3]:
        pytest.skip(f"the ring group does not add up here: {results}")


# ----------------------------------------------------------------------------- the tests


def test_tensor_parallel_greedy_is_reproducible_and_matches_one_process(
    ring: None, models: dict[str, str], tmp_path: Path
) -> None:
    import numpy as np

    spec = {"model": models["a"], "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
    alone = single("greedy", tmp_path / "single", **spec)
    first, output = launch("greedy", tmp_path / "tp1", **spec)
    second, _ = launch("greedy", tmp_path / "tp2", **spec)
    assert alone["mode"] == "none"
    for run in (first, second):
        assert not any("error" in r for r in run), f"{[r.get('error') for r in run]}\n{output}"
        assert [r["mode"] for r in run] == ["tensor", "tensor"]
        assert [r["world"]["world_size"] for r in run] == [2, 2]
        # Followers decoded prompts they only ever saw in a plan, to the same bytes as rank 0.
        assert run[1]["tokens"] == run[0]["tokens"]
        assert run[1]["logprobs_sha256"] == run[0]["logprobs_sha256"]
        assert run[1]["plans"] == run[0]["plans"]
        assert run[1]["odd"] == run[0]["odd"] == [repr(v) for v in ODD_VALUES]
    assert first[0]["fingerprint"] == first[1]["fingerprint"] == second[0]["fingerprint"]
    # Two TP = 2 runs: the same logprob bytes, not only the same tokens.
    assert second[0]["logprobs_sha256"] == first[0]["logprobs_sha256"]
    assert [len(t) for t in first[0]["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    # TP = 2 against one process: the split sums round differently, so the logprobs may differ in
    # the last bits (float32 here); the greedy tokens must not.
    assert first[0]["tokens"] == alone["tokens"]
    tp = np.load(tmp_path / "tp1" / "out" / "logprobs.npy")
    one = np.load(tmp_path / "single" / "out" / "logprobs.npy")
    diff = float(np.abs(tp - one).max())
    print(
        f"TP=2 vs 1 process: tokens equal; logprob bytes equal: {tp.tobytes() == one.tobytes()}; max |diff| {diff:.3g}"
    )
    assert diff < 1e-4


def test_a_pipeline_split_decodes_the_same_bytes_as_one_process(ring: None, tmp_path: Path) -> None:
    """qwen2 has both splits; by layers, each rank's sums are whole, so nothing rounds differently."""
    from workers.synthetic import qwen3_config, write_model

    config = {**qwen3_config(hidden=128, layers=4, dtype="float32"), "model_type": "qwen2"}
    model = str(write_model(tmp_path / "qwen2", config, seed=3))
    spec: dict[str, Any] = {"model": model, "prompts": PROMPTS[:2], "max_tokens": MAX_TOKENS, "mode": "pipeline"}
    alone = single("greedy", tmp_path / "single", **spec)
    run, output = launch("greedy", tmp_path / "pp", **spec)
    assert not any("error" in r for r in run), f"{[r.get('error') for r in run]}\n{output}"
    assert [r["mode"] for r in run] == ["pipeline", "pipeline"]
    assert run[0]["tokens"] == run[1]["tokens"] == alone["tokens"]
    assert run[0]["logprobs_sha256"] == run[1]["logprobs_sha256"] == alone["logprobs_sha256"]


def test_the_engine_in_lockstep_serves_what_one_process_does(
    ring: None, models: dict[str, str], tmp_path: Path
) -> None:
    from workers.synthetic import BYTE_VOCAB

    spec = {"model": models["a"], "vocab": BYTE_VOCAB}
    alone = single("engine", tmp_path / "single", **spec)
    run, output = launch("engine", tmp_path / "tp", **spec)
    assert not any("error" in r for r in run), f"{[r.get('error') for r in run]}\n{output}"
    assert [r["mode"] for r in run] == ["tensor", "tensor"]
    assert run[0]["iterations"] == run[1]["iterations"] == alone["iterations"]
    assert run[0]["tokens"] == run[1]["tokens"] == alone["tokens"]
    assert len(alone["tokens"]) == 4 and len(alone["tokens"]["1"]) < MAX_TOKENS  # seq 1 was cancelled


def test_ranks_with_different_weights_stop_with_one_line(ring: None, models: dict[str, str], tmp_path: Path) -> None:
    results, output = launch("load", tmp_path, models=[models["a"], models["b"]])
    for r in results:
        assert r["kind"] == "ShardError"
        assert "the ranks loaded different weights" in r["error"] and "rank 1 has" in r["error"]
        assert "\n" not in r["error"]
    assert output.count("mlx-batchd: the ranks loaded different weights") == 2, output


def test_a_world_size_that_does_not_divide_the_heads_stops_with_one_line(
    ring: None, models: dict[str, str], tmp_path: Path
) -> None:
    # Ranks started by hand: under mlx.launch the first rank to fail gets the other one SIGTERMed,
    # sometimes before it has written its own answer.
    ranks = Ranks("load", tmp_path, model=models["one_kv_head"])
    try:
        for rank in range(2):
            ranks.wait(rank, RUN_TIMEOUT)
        results = [ranks.result(rank) for rank in range(2)]
        output = ranks.output()
    finally:
        ranks.close()
    for r in results:
        assert r["kind"] == "ShardError"
        assert "num_key_value_heads=1 is not divisible by the world size 2" in r["error"]
        assert "'llama'" in r["error"] and "\n" not in r["error"]
    assert "Traceback" not in output


@pytest.fixture()
def serving(ring: None, models: dict[str, str], tmp_path: Path) -> Iterator[Ranks]:
    ranks = Ranks("serve", tmp_path, model=models["a"])
    try:
        ranks.wait_ready()
        yield ranks
    finally:
        ranks.close()


@pytest.mark.parametrize("dead", [0, 1])
def test_a_dead_rank_makes_the_other_exit_non_zero(serving: Ranks, dead: int) -> None:
    survivor = 1 - dead
    os.kill(serving.result(dead)["pid"], signal.SIGKILL)
    code = serving.wait(survivor, DEATH_TIMEOUT)
    assert code != 0, serving.output()
    assert serving.result(survivor)["kind"] in ("PeerLost", "RuntimeError"), serving.output()


def test_sigterm_of_rank_0_stops_every_rank_cleanly(serving: Ranks) -> None:
    time.sleep(0.5)  # some plans go by first
    os.kill(serving.result(0)["pid"], signal.SIGTERM)
    assert serving.wait(0, DEATH_TIMEOUT) == 0, serving.output()
    assert serving.wait(1, DEATH_TIMEOUT) == 0, serving.output()
    leader, follower = serving.result(0), serving.result(1)
    assert leader["stopped_by"] == "sigterm"
    assert follower["applied"] == leader["applied"] > 0


def test_a_rank_killed_under_mlx_launch_does_not_hang_the_launcher(
    ring: None, models: dict[str, str], tmp_path: Path
) -> None:
    spec_path, out = _spec(tmp_path, model=models["a"])
    proc = _launcher("serve", tmp_path, spec_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not all((out / f"rank{r}.json").exists() for r in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not get ready"
            time.sleep(0.1)
        os.kill(json.loads((out / "rank1.json").read_text())["pid"], signal.SIGKILL)
        proc.wait(DEATH_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"mlx.launch still runs {DEATH_TIMEOUT} s after rank 1 died") from None
    finally:
        _kill_group(proc)


# ----------------------------------------------------------------------------- the daemon across two ranks

#: The options every daemon below runs with (one process or two ranks): room for a long stream.
SERVE_OPTIONS = ["--max-tokens-cap", "4000"]
LONG = 3000
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")


def _serve_command(model: str, address: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "scheduler", "serve", "--model", model, "--listen", address, *SERVE_OPTIONS, *extra]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _gone(pids: list[int], timeout: float = DEATH_TIMEOUT) -> list[int]:
    """The ``pids`` still alive ``timeout`` seconds from now (at once when none is)."""
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _wait_ready(address: str, procs: list[subprocess.Popen[bytes]], output: Any) -> None:
    """The daemon's ready handshake, failing at once (with every rank's output) when a process exits."""
    from clients import Client

    deadline = time.monotonic() + RUN_TIMEOUT
    with Client(address, timeout=RUN_TIMEOUT) as client:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            try:
                client.wait_ready(timeout=1.0)
                return
            except TimeoutError:
                continue
    raise AssertionError(f"the daemon did not get ready:\n{output()}")


class RankDaemon(Ranks):
    """``mlx-batchd serve`` as two ranks started by hand (``MLX_RANK``, ``MLX_HOSTFILE``)."""

    def __init__(self, tmp: Path, models: list[str], *extra: str, envs: list[dict[str, str]] | None = None) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.address = f"ipc://{tmp / 'd.sock'}"
        self.start(tmp, [_serve_command(m, self.address, *extra) for m in models], envs)

    def wait_ready(self) -> None:
        _wait_ready(self.address, self.procs, self.output)

    def close(self) -> None:
        leftovers = [c for c in _children(self.procs[0].pid)] if self.procs[0].poll() is None else []
        super().close()
        for pid in leftovers:  # the engine process has a session of its own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class LaunchedDaemon:
    """``mlx.launch --backend ring -n 2 -- mlx-batchd serve ...``, exactly as the README says."""

    def __init__(self, tmp: Path, model: str) -> None:
        self.address = f"ipc://{tmp / 'd.sock'}"
        self.log_path = tmp / "launch.log"
        cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--starting-port", str(_free_ports()), "--"]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd + _serve_command(model, self.address),
                cwd=ROOT,
                env={**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        _wait_ready(self.address, [self.proc], self.output)

    def ranks(self) -> dict[int, int]:
        """Rank -> pid of the processes ``mlx.launch`` started (from their environment)."""
        found = {}
        for pid in _children(self.proc.pid):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [e.split(b"=", 1)[1] for e in env if e.startswith(b"MLX_RANK=")]
            if rank:
                found[int(rank[0])] = pid
        return found

    def close(self) -> None:
        _kill_group(self.proc)


def _greedy_stream(address: str, prompt: list[int], out: dict[int, Any], key: int) -> None:
    from clients import Client

    with Client(address, timeout=RUN_TIMEOUT) as c:
        r = c.generate(tokens=prompt, max_tokens=MAX_TOKENS, logprobs=True)
        out[key] = (r.tokens, r.logprobs, r.finish_reason)


def _workload(address: str) -> dict[str, Any]:
    """Three greedy requests at once (so they share batched steps), then a seeded sampled one and
    an unseeded one, through the client library; what came back."""
    import threading

    from clients import Client

    greedy: dict[int, Any] = {}
    threads = [threading.Thread(target=_greedy_stream, args=(address, p, greedy, i)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RUN_TIMEOUT)
    assert len(greedy) == len(PROMPTS), "a greedy request did not finish"
    with Client(address, timeout=RUN_TIMEOUT) as c:
        sampled = c.generate(tokens=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.9, seed=1234).tokens
        unseeded = c.generate(tokens=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0.9)
        engine = c.stats()["engine"]
    assert unseeded.finish_reason in ("length", "stop")
    return {"greedy": [greedy[i] for i in range(len(PROMPTS))], "sampled": sampled, "engine": engine}


def _long_stream(address: str, results: list[Any], started: Any) -> None:
    """A stream that runs until something ends it; every event it got."""
    from clients import Client, RequestError, TokenEvent

    with Client(address, timeout=RUN_TIMEOUT) as c:
        try:
            for event in c.stream(tokens=PROMPTS[0], max_tokens=LONG):
                results.append(event)
                if isinstance(event, TokenEvent) and len(results) == 1:
                    started.set()
        except RequestError as exc:  # the daemon itself went away: the client says so
            results.append(exc)
    started.set()


def _stream_in_flight(address: str) -> tuple[list[Any], Any]:
    import threading

    results: list[Any] = []
    started = threading.Event()
    thread = threading.Thread(target=_long_stream, args=(address, results, started), daemon=True)
    thread.start()
    assert started.wait(RUN_TIMEOUT) and results, "the stream never started"
    return results, thread


def _ends(events: list[Any]) -> list[Any]:
    from clients import EndEvent

    ends = [e for e in events if isinstance(e, EndEvent)]
    assert len(ends) == 1 and events[-1] is ends[0], f"not exactly one terminal event, last: {events[-1:]}"
    return ends


@pytest.fixture(scope="module")
def launched(ring: None, models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedDaemon]:
    daemon = LaunchedDaemon(tmp_path_factory.mktemp("launched"), models["a"])
    try:
        daemon.wait_ready()
        yield daemon
    finally:
        daemon.close()


@pytest.fixture(scope="module")
def launched_results(launched: LaunchedDaemon) -> dict[str, Any]:
    return _workload(launched.address)


def test_two_ranks_serve_what_one_process_serves(
    launched: LaunchedDaemon, launched_results: dict[str, Any], models: dict[str, str], tmp_path: Path
) -> None:
    import numpy as np

    from tests.conftest import start_daemon

    one = start_daemon(models["a"], tmp_path / "one", *SERVE_OPTIONS)
    try:
        alone = _workload(one.address)
    finally:
        assert one.stop() == 0, one.log()
    two = launched_results
    assert "2 ranks, ring, tensor" in launched.output()
    assert two["engine"]["distributed"] == {"world_size": 2, "rank": 0, "backend": "ring", "mode": "tensor"}
    assert alone["engine"]["distributed"] == {"world_size": 1, "rank": 0, "backend": "single", "mode": "none"}
    # Greedy: the same tokens as one process. The logprobs are not the same bytes: each rank sums
    # half of every attention and MLP output and the ring adds the halves, which rounds differently
    # from one sum over the whole (float32 here).
    assert [g[0] for g in two["greedy"]] == [g[0] for g in alone["greedy"]]
    assert all(len(g[0]) == MAX_TOKENS or g[2] == "stop" for g in two["greedy"])
    diff = max(float(np.abs(np.array(a[1]) - np.array(b[1])).max()) for a, b in zip(two["greedy"], alone["greedy"]))
    print(f"daemon TP=2 vs one process: greedy tokens equal, max |logprob diff| {diff:.3g}")
    assert diff < 1e-4


def test_cancel_and_disconnect_behave_as_in_one_process(
    launched: LaunchedDaemon, launched_results: dict[str, Any]
) -> None:
    from clients import Client, TokenEvent

    with Client(launched.address, timeout=RUN_TIMEOUT) as c:
        events = []
        for event in c.stream(tokens=PROMPTS[0], max_tokens=LONG, request_id="cancel-me"):
            events.append(event)
            if isinstance(event, TokenEvent) and len(events) == 2:
                c.cancel("cancel-me")
        (end,) = _ends(events)
        assert end.finish_reason == "cancelled" and end.usage["completion_tokens"] < LONG
        for event in c.stream(tokens=PROMPTS[1], max_tokens=LONG):
            assert isinstance(event, TokenEvent)
            break  # leaving the stream cancels it
        deadline = time.monotonic() + DEATH_TIMEOUT
        while time.monotonic() < deadline:
            stats = c.stats()
            if stats["requests_in_flight"] == 0 and stats["engine"]["active_sequences"] == 0:
                break
            time.sleep(0.05)
        assert stats["requests_in_flight"] == 0 and stats["engine"]["active_sequences"] == 0
        # The ranks are still in step: the same greedy answer as before the cancels.
        again = c.generate(tokens=PROMPTS[0], max_tokens=MAX_TOKENS, logprobs=True)
    assert (again.tokens, again.logprobs) == tuple(launched_results["greedy"][0][:2])


@linux_only
def test_sigterm_of_rank_0_under_mlx_launch_ends_the_whole_launch(
    launched: LaunchedDaemon, launched_results: dict[str, Any]
) -> None:
    ranks = launched.ranks()
    assert sorted(ranks) == [0, 1], launched.output()
    (engine_process,) = _children(ranks[0])
    events, thread = _stream_in_flight(launched.address)
    os.kill(ranks[0], signal.SIGTERM)
    try:
        launched.proc.wait(DEATH_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"mlx.launch still runs {DEATH_TIMEOUT} s after SIGTERM:\n{launched.output()}") from None
    thread.join(DEATH_TIMEOUT)
    (end,) = _ends(events)
    assert end.error is not None and end.error.code == "shutdown", end
    assert _gone([*ranks.values(), engine_process]) == [], launched.output()


@linux_only
def test_a_second_run_is_identical_and_sigterm_of_rank_0_stops_every_rank(
    launched_results: dict[str, Any], models: dict[str, str], tmp_path: Path
) -> None:
    daemon = RankDaemon(tmp_path, [models["a"]] * 2)
    try:
        daemon.wait_ready()
        second = _workload(daemon.address)
        # Two runs of two ranks: the same tokens and the same logprob bytes, sampled ones included.
        assert second["greedy"] == launched_results["greedy"]
        assert second["sampled"] == launched_results["sampled"]
        (engine_process,) = _children(daemon.procs[0].pid)
        events, thread = _stream_in_flight(daemon.address)
        daemon.procs[0].send_signal(signal.SIGTERM)
        assert daemon.wait(0, DEATH_TIMEOUT) == 0, daemon.output()
        assert daemon.wait(1, DEATH_TIMEOUT) == 0, daemon.output()
        thread.join(DEATH_TIMEOUT)
        (end,) = _ends(events)
        assert end.finish_reason == "error" and end.error is not None and end.error.code == "shutdown", end
        assert _gone([engine_process]) == [], "the engine process outlived its daemon"
    finally:
        daemon.close()


@linux_only
@pytest.mark.parametrize("dead", [1, 0], ids=["follower", "daemon"])
def test_a_dead_rank_ends_every_request_and_every_rank(models: dict[str, str], tmp_path: Path, dead: int) -> None:
    """A follower killed: the daemon ends every request ``engine_dead`` and exits 1, as when one
    process's engine dies (within ``--rank-timeout`` where the ring's collective never returns). The daemon killed: its engine process stops and the follower exits 1
    (the clients see ``daemon_gone``, as from any daemon killed)."""
    daemon = RankDaemon(tmp_path, [models["a"]] * 2, "--rank-timeout", "10")
    try:
        daemon.wait_ready()
        (engine_process,) = _children(daemon.procs[0].pid)
        events, thread = _stream_in_flight(daemon.address)
        daemon.procs[dead].kill()
        assert daemon.wait(1 - dead, DEATH_TIMEOUT) == 1, daemon.output()
        thread.join(DEATH_TIMEOUT)
        if dead:
            (end,) = _ends(events)
            assert end.finish_reason == "error" and end.error is not None and end.error.code == "engine_dead", end
        else:
            assert getattr(events[-1], "code", None) == "daemon_gone", events[-1:]
        assert _gone([engine_process]) == [], daemon.output()
        # A ring collective whose peer died mid-transfer may wait for good (mlx 0.32.4 left 3 of 10
        # such kills waiting): then the watchdog (--rank-timeout) ends the rank instead.
        said = ("group broke", "rank-timeout") if dead else ("its daemon is gone",)
        assert any(s in daemon.output() for s in said), daemon.output()
        assert "Traceback" not in daemon.output(), daemon.output()
    finally:
        daemon.close()


def _verdict(address: str) -> dict[str, Any]:
    from clients import Client

    deadline = time.monotonic() + RUN_TIMEOUT
    with Client(address, timeout=RUN_TIMEOUT) as c:
        while time.monotonic() < deadline:
            done = [v for v in c.stats()["engine"]["verdicts"].values() if "level" in v]
            if done:
                return done[0]
            time.sleep(0.1)
    raise AssertionError("no verdict")


@linux_only
def test_the_probe_and_bursts_run_on_the_sharded_model(
    launched_results: dict[str, Any], models: dict[str, str], tmp_path: Path, private_cache: Path
) -> None:
    """The probe runs on the split model (its verdict stored per world size and split, and read back
    by the next start for every rank: rank 1 has a fresh cache of its own each time, as on another
    machine, and never holds the verdict), and a lone greedy request bursts on it."""
    from clients import Client

    found = []
    for run in ("probed", "stored"):
        envs = [{}, {"MLX_BATCHD_CACHE": str(tmp_path / f"rank1-cache-{run}")}]
        daemon = RankDaemon(tmp_path / run, [models["a"]] * 2, "--draft", "prompt-lookup", "-k", "3", envs=envs)
        try:
            daemon.wait_ready()
            verdict = _verdict(daemon.address)
            with Client(daemon.address, timeout=RUN_TIMEOUT) as c:
                r = c.generate(tokens=PROMPTS[0], max_tokens=MAX_TOKENS, logprobs=True)
                bursts = c.stats()["engine"]["bursts"]
            found.append(verdict["from_cache"])
            assert verdict["level"] is not None, verdict  # the CPU backend's sums are exact at wide
            assert r.tokens == launched_results["greedy"][0][0]
            assert bursts["rounds"] > 0 and bursts["audit_failures"] == 0, bursts
            daemon.procs[0].send_signal(signal.SIGTERM)
            assert [daemon.wait(r, DEATH_TIMEOUT) for r in range(2)] == [0, 0], daemon.output()
        finally:
            daemon.close()
    assert found == [False, True]
    stored = [json.loads(f.read_text())["pairing"] for f in (private_cache / "verdicts").glob("*.json")]
    assert {"world_size": 2, "backend": "ring", "mode": "tensor"} in [p.get("distributed") for p in stored]
    assert not list(tmp_path.glob("rank1-cache-*/verdicts"))


@linux_only
def test_a_stuck_rank_is_given_up_after_the_rank_timeout(models: dict[str, str], tmp_path: Path) -> None:
    """A follower that stops answering without dying (here SIGSTOP) leaves rank 0 inside a
    collective that never returns and raises nothing; past --rank-timeout the daemon ends every
    request ``engine_dead`` and exits 1."""
    daemon = RankDaemon(tmp_path, [models["a"]] * 2, "--rank-timeout", "3")
    try:
        daemon.wait_ready()
        (engine_process,) = _children(daemon.procs[0].pid)
        events, thread = _stream_in_flight(daemon.address)
        daemon.procs[1].send_signal(signal.SIGSTOP)
        assert daemon.wait(0, DEATH_TIMEOUT) == 1, daemon.output()
        thread.join(DEATH_TIMEOUT)
        (end,) = _ends(events)
        assert end.error is not None and end.error.code == "engine_dead", end
        assert _gone([engine_process]) == [], daemon.output()
        assert "ran past --rank-timeout 3 s" in daemon.output(), daemon.output()
    finally:
        daemon.close()  # SIGKILL ends the stopped follower too


@linux_only
def test_a_set_up_that_cannot_serve_is_refused_on_every_rank(models: dict[str, str], tmp_path: Path) -> None:
    """Heads that do not divide: refused before anything is bound, on each rank, exit 2. Different
    weights: found when the ranks meet, every rank stops non-zero saying so, no traceback."""
    heads = RankDaemon(tmp_path / "heads", [models["one_kv_head"]] * 2)
    weights = RankDaemon(tmp_path / "weights", [models["a"], models["b"]])
    try:
        assert [heads.wait(r, RUN_TIMEOUT) for r in range(2)] == [2, 2], heads.output()
        lines = [line for line in heads.output().splitlines() if line.startswith("mlx-batchd serve:")]
        assert len(lines) == 2 and all("num_key_value_heads=1 is not divisible by the world size 2" in x for x in lines)
        assert not (tmp_path / "heads" / "d.sock").exists()
        assert [weights.wait(r, RUN_TIMEOUT) for r in range(2)] == [1, 1], weights.output()
        assert weights.output().count("the ranks loaded different weights") == 2, weights.output()
        assert "Traceback" not in heads.output() + weights.output()
    finally:
        heads.close()
        weights.close()


def test_a_rank_whose_peers_never_join_stops_at_the_join_timeout(
    ring: None, models: dict[str, str], tmp_path: Path
) -> None:
    """``mx.distributed.init`` waits for the ring's peers for good, holding the GIL: without the
    alarm a rank started by hand whose partner refused its set-up would wait forever."""
    spec_path, _ = _spec(tmp_path, model=models["a"], join_timeout=2)
    hostfile = tmp_path / "hosts.json"
    port = _free_ports()
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = {**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)}
    alone = subprocess.Popen(_rank_command("load", spec_path), cwd=ROOT, env=env, start_new_session=True)
    try:
        assert alone.wait(DEATH_TIMEOUT) == -signal.SIGALRM
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a rank alone still waits {DEATH_TIMEOUT} s later") from None
    finally:
        _kill_group(alone)


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], sys.argv[2]))
