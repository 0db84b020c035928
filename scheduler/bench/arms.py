"""The matrix's arms and what they read from a daemon: the raw ``BatchGenerator`` peer and the engine
alone (in this process), a daemon through the client library, the daemon's HTTP door through
``httpx``; the workload's prompts, the step and burst counters, and the wait for idle daemons."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from scheduler.bench.env_arms import EnvArm
from scheduler.bench.output import BenchError
from workers import envs


def random_prompts(b: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    """``b`` prompts of ``n`` random token ids from ``seed``: every arm of a repeat gets the same ones."""
    rng = random.Random(seed)
    return [[rng.randrange(4, min(vocab, 256)) for _ in range(n)] for _ in range(b)]


def text_prompts(tokenizer: Any, texts: list[str], b: int, seed: int) -> list[list[int]]:
    """``b`` prompts from ``texts`` (encoded with the served model's tokenizer), starting at text
    ``seed`` and cycling: every arm of a repeat gets the same ones, and a repeat's seed picks where
    the cycle starts. For drafters whose acceptance depends on what they read (a head trained on the
    demo's corpus accepts far less on random token ids)."""
    encoded = [list(tokenizer.encode(t)) for t in texts]
    return [encoded[(seed + i) % len(encoded)] for i in range(b)]


def run_raw(model: Any, eos: list[int], prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Generated tokens and seconds for one workload on a fresh ``BatchGenerator``, on stock MLX and
    mlx-lm (the project's kernel patches are lifted for the run): the peer, as mlx_lm.server runs it."""
    from mlx_lm.generate import BatchGenerator

    from workers.kernels import stock

    with stock():
        gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in eos],
            completion_batch_size=max(32, len(prompts)),
            prefill_batch_size=8,
        )
        tic = time.perf_counter()
        gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        produced = 0
        while responses := gen.next_generated():
            produced += sum(1 for r in responses if r.finish_reason != "stop")
        wall = time.perf_counter() - tic
        gen.close()
    return produced, wall


STEP_COUNTERS = (
    "steps",
    "step_seconds",
    "step_cpu_seconds",
    "step_preemptions",
    "decode_steps",
    "decode_seconds",
    "prefill_steps",
    "finish_steps",
)
#: A daemon's engine loop (``stats.engine.loop``): its iterations and the seconds its engine thread
#: spent handing events to the front end (no such loop in the engine-alone arm).
LOOP_COUNTERS = ("iterations", "emit_seconds")
#: A daemon's admission (``stats.engine.admission``): the seconds its idle engine held arrivals before
#: starting them (a declared group gathering: the engine alone has all its prompts at once).
ADMISSION_COUNTERS = ("idle_hold_seconds",)


def step_counters(engine_stats: dict[str, Any]) -> dict[str, float]:
    """The engine's step counters from its stats (``stats.engine`` or ``asdict(counters)``), with a
    daemon's loop counters where its stats have them."""
    counters = {k: engine_stats.get(k, 0) for k in STEP_COUNTERS}
    loop = engine_stats.get("loop")
    if loop:
        counters |= {k: loop.get(k, 0) for k in LOOP_COUNTERS}
    admission = engine_stats.get("admission")
    if admission:
        counters |= {k: admission.get(k, 0) for k in ADMISSION_COUNTERS}
    return counters


def run_engine(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """The project's engine in this process, no front end and no sockets: the daemon's ceiling."""
    from workers.api import Job, Tokens

    tic = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(Job(seq=i, prompt=p, max_tokens=max_tokens))
    produced = 0
    while engine.has_work:
        produced += sum(len(e.tokens) for e in engine.step() if isinstance(e, Tokens))
    return produced, time.perf_counter() - tic


def run_daemon(client: Any, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Every request at once through one client (``Client.generate_many``: sent from its one event
    loop, as the engine arm submits them all before its first step; a thread a request spread the
    sends of 128 over more than the daemon's admission hold, and the group prefilled in two waves)."""
    tic = time.perf_counter()
    results = client.generate_many([{"tokens": p, "max_tokens": max_tokens} for p in prompts])
    wall = time.perf_counter() - tic
    return sum(r.usage["completion_tokens"] for r in results), wall


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a daemon's ``--http``: the daemon prints its address but
    the bench does not read its output, so the bench picks the port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _completion_body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    """The ZeroMQ arm's request as an OpenAI completion: the same token ids (``prompt`` as a token
    list), the same budget, greedy; a stream asks for its usage so tokens are counted as the daemon
    counted them."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def http_generate(http: Any, model: str, prompt: list[int], max_tokens: int, stream: bool) -> int:
    """One completion through the HTTP door with ``http`` (an ``httpx.Client``); its completion
    tokens, from the answer's ``usage`` (a stream's last chunk)."""
    body = _completion_body(model, prompt, max_tokens, stream)
    if not stream:
        reply = http.post("/v1/completions", json=body)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])
    usage = None
    with http.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the HTTP stream ended with an error: {chunk['error']}")
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("the HTTP stream ended without its usage chunk")
    return int(usage["completion_tokens"])


def run_http(http: Any, model: str, prompts: list[list[int]], max_tokens: int, stream: bool) -> tuple[int, float]:
    """``run_daemon`` through the HTTP door: every request at once, one thread each, on one
    connection pool (an HTTP client's way; the ZeroMQ arm sends from one event loop)."""
    tic = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        produced = list(pool.map(lambda p: http_generate(http, model, p, max_tokens, stream), prompts))
    return sum(produced), time.perf_counter() - tic


def open_http(url: str) -> Any:
    """An ``httpx.Client`` for the HTTP arms: no cap on pooled connections (every request of a batch
    holds one at once), no timeout a long run could hit."""
    import httpx

    return httpx.Client(
        base_url=url,
        timeout=3600,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


def served_model(http: Any) -> str:
    """The served model's id, as a stock client finds it: ``GET /v1/models``."""
    reply = http.get("/v1/models")
    reply.raise_for_status()
    return str(reply.json()["data"][0]["id"])


#: The HTTP arms (``--via http``): the ``daemon`` arm's own daemon through its HTTP door, whole
#: answers and SSE streams; arm -> stream.
HTTP_ARMS = {"http": False, "http_stream": True}


@dataclass(frozen=True)
class DaemonArms:
    """The daemons a matrix run starts: each arm's serve options and the environment set for it alone."""

    serve: dict[str, list[str]]
    env: dict[str, dict[str, str]]
    env_arms: list[EnvArm]
    #: ``bursts:<drafter>``, one daemon each, measured at B = 1 only.
    b1_arms: list[str]


def daemon_arms(args: argparse.Namespace, cap: list[str], http_flags: list[str], drafters: list[str]) -> DaemonArms:
    """The daemon arm (with the HTTP door where ``--via http``), ``--process-pin``'s daemon (the
    process-wide pin is a bench arm, not a serve option), one per ``--env-arm`` (its ZeroMQ door only)
    and one per drafter."""
    serve: dict[str, list[str]] = {"daemon": [*cap, *http_flags]}
    env: dict[str, dict[str, str]] = {}
    if args.process_pin:
        serve["daemon_process_pin"] = [*cap, "--probe-k", "4", "--pin-level", args.process_pin]
        env["daemon_process_pin"] = {envs.BENCH_PROCESS_PIN.name: "1"}
    env_arms: list[EnvArm] = list(getattr(args, "env_arm", None) or [])
    for a in env_arms:
        serve[a.name] = [*cap, *a.serve_args]
        env[a.name] = a.variables
    b1_arms = [f"bursts:{d}" for d in drafters]
    for arm, d in zip(b1_arms, drafters):
        serve[arm] = [*cap, *drafter_args(d)]
    return DaemonArms(serve, env, env_arms, b1_arms)


@contextlib.contextmanager
def failing_arm(arm: str) -> Iterator[None]:
    """A request the arm's daemon failed (its engine died, a request it refused) ends the bench with
    one line naming the arm and the error's code, not a traceback."""
    from clients import RequestError

    try:
        yield
    except RequestError as exc:
        raise BenchError(f"arm {arm}: a request failed: [{exc.code}] {exc.message}") from None


def drafter_args(spec: str) -> list[str]:
    """Daemon flags for one drafter spec: ``mtp:DIR|demo`` is an MTP head, anything else ``--draft``;
    a suffix ``@K`` sets the drafted tokens a round (``-k``), so one bench can run one drafter at
    several K, its arms alternating with the same classic arm."""
    spec, at, k = spec.partition("@")
    flags = ["--mtp", spec.split(":", 1)[1]] if spec.startswith("mtp:") else ["--draft", spec]
    if at:
        if not k.isascii() or not k.isdigit() or int(k) < 1:  # "²" is a digit that int() refuses
            raise BenchError(f"drafter {spec}@{k}: K after @ must be a positive integer")
        flags += ["-k", k]
    return flags


BURST_COUNTS = ("rounds", "drafted_tokens", "accepted_tokens", "emitted_tokens", "ahead_rounds", "fused_rounds")
#: What each timed run's record keeps of a drafter arm's counters (``burst_counts``, after minus before).
RUN_BURST_KEYS = ("rounds", "round_seconds", "ahead_rounds", "fused_rounds")


def daemon_bursts(client: Any) -> dict[str, Any]:
    """The daemon's ``bursts`` stats (empty where it reports none)."""
    return client.stats()["engine"].get("bursts") or {}


def burst_counts(b: dict[str, Any]) -> dict[str, float]:
    """A daemon's burst counters (``BURST_COUNTS``) from its ``bursts`` stats (``daemon_bursts``), the
    seconds its rounds took (``round_seconds``) and its declined bursts by reason, as
    ``declined:<reason>`` (so an arm where no round ran can say why)."""
    counts: dict[str, float] = {k: int(b.get(k, 0)) for k in BURST_COUNTS}
    counts["round_seconds"] = float(b.get("round_seconds", 0.0))
    counts.update({f"declined:{reason}": int(n) for reason, n in (b.get("declined") or {}).items()})
    return counts


def memory_gib() -> dict[str, float]:
    """MLX's active, cached and peak memory in this process, GiB."""
    import mlx.core as mx

    gib = 2.0**30
    return {
        "active": mx.get_active_memory() / gib,
        "cache": mx.get_cache_memory() / gib,
        "peak": mx.get_peak_memory() / gib,
    }


def _idle(engine: dict[str, Any]) -> bool:
    """Whether a daemon's engine is doing nothing: started, no probe queued or running, no start-up
    work (``start_up``, where its stats have it) pending or running, no sequence."""
    verdicts = engine.get("verdicts", {})
    start_up = (engine.get("start_up") or {}).values()
    return (
        bool(engine)
        and not engine.get("active_sequences")
        and all("level" in v for v in verdicts.values())
        and all(w.get("status") in ("done", "failed") for w in start_up)
    )


def wait_idle(clients: dict[str, Any], poll_s: float = 0.05) -> None:
    """Until every daemon is idle (``_idle``), the ones that never probe included. A daemon's start-up
    probe runs whenever it has nothing to serve, so a daemon still probing would share the GPU with the
    arm being timed."""
    for c in clients.values():
        while not _idle(c.stats()["engine"]):
            time.sleep(poll_s)  # polling a daemon that offers no completion event
