"""What the distributed tests share: their tiny models, the ``ring`` skip, and the ways to start ranks.

Ranks run the rank program (``tests.helpers.rank_program``) under ``mlx.launch --backend ring -n 2``
as a user would, or, where a test needs each rank's own exit status, with the environment
``mlx.launch`` sets (``MLX_RANK``, ``MLX_HOSTFILE``): ``mlx.launch`` exits 0 whatever its ranks did and
SIGTERMs the others as soon as one fails, which would hide whether a survivor notices on its own.
The daemon runs the same two ways (``LaunchedDaemon``, ``RankDaemon``). Every process runs under a
timeout and is killed with its whole process group, so nothing outlives a test.
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
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.processes import _alive as _alive
from tests.helpers.processes import _children as _children
from tests.helpers.rank_program import MAX_TOKENS, PROMPTS, RUN_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = Path(sys.executable).parent / "mlx.launch"
#: Seconds a survivor may take to exit after its peer died.
DEATH_TIMEOUT = 60


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny random float32 llamas: two seeds of one shape, and one whose 1 KV head cannot split in two."""
    from workers.models.synthetic import llama_config, write_model

    root = tmp_path_factory.mktemp("dist-models")

    def config(kv_heads: int) -> dict[str, Any]:
        return llama_config(hidden=128, layers=2, ffn=256, heads=4, kv_heads=kv_heads, dtype="float32")

    return {
        "a": str(write_model(root / "a", config(2), seed=7)),
        "b": str(write_model(root / "b", config(2), seed=8)),
        "one_kv_head": str(write_model(root / "kv1", config(1), seed=7)),
    }


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
    return [sys.executable, "-m", "tests.helpers.rank_program", scenario, str(spec)]


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


# ----------------------------------------------------------------------------- the daemon across two ranks

#: The options every daemon of the distributed tests runs with (one process or two ranks): room for a long stream.
SERVE_OPTIONS = ["--max-tokens-cap", "4000"]
LONG = 3000
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")


def _serve_command(model: str, address: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "scheduler", "serve", "--model", model, "--listen", address, *SERVE_OPTIONS, *extra]


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
