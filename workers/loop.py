"""The engine thread: the one owner of the engine loop and of every MLX object.

Commands come in through a thread-safe inbox and never wait on anything; events go out through
an ``emit`` callback the caller supplies (the daemon hands them to its event loop). The loop
blocks only when it has nothing to decode, so network I/O never stalls a decode step, and a
decode step never stalls the network.

Lifecycle, as in vLLM's engine core: ``Ready`` once the model is loaded and warmed up, then
events, then ``Stopped`` after a shutdown, or ``Dead`` if the loop itself failed.

One model over several ranks (docs/distributed.md) runs one of these per rank: each iteration is
decided by rank 0 (``_decide``: the commands, seeds for unseeded sampled jobs, every choice that
reads the clock) and published as a ``workers.distributed.Plan``; every rank applies the plans with
the same code (``_apply``), so all run the same forwards, and each follower checks rank 0's state
in the plan against its own before applying it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import queue
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import msgpack

from workers import faults
from workers.burst import BurstSettings, Gate
from workers.distributed import (
    IDLE_WAIT_S,
    Broadcaster,
    DistributedError,
    Lockstep,
    Mode,
    Plan,
    World,
    as_peer_lost,
    check_same,
)
from workers.engine import Engine, Event, Finished, Job, PinScope, Tokens
from workers.kernels import Level
from workers.models import LoadedModel, ModelError, ModelInfo
from workers.params import SamplingParams
from workers.probe import ProbePolicy, sliding_window
from workers.probe_results import Verdict
from workers.probe_setup import ProbeSetup, probe_setup
from workers.sampling import is_greedy
from workers.snapshot import (
    BurstSummary,
    DistributedSnapshot,
    EngineSnapshot,
    PinsSnapshot,
    PinTax,
    PrefixCacheSnapshot,
    ProbingRow,
    VerdictRow,
)
from workers.verdict_store import VerdictStore

log = logging.getLogger("mlx_batchd.engine")


@dataclass
class Ready:
    info: ModelInfo
    tokenizer: Any


@dataclass
class Stopped:
    pass


@dataclass
class Dead:
    error: str


Signal = Event | Ready | Stopped | Dead


@dataclass
class _Submit:
    job: Job


@dataclass
class _Cancel:
    seq: int
    reason: str
    code: str | None
    message: str | None


@dataclass
class _Pause:
    seq: int


@dataclass
class _Resume:
    seq: int


@dataclass
class _Shutdown:
    reason: str
    code: str
    message: str


@dataclass
class _MeasureTax:
    pass


_Command = _Submit | _Cancel | _Pause | _Resume | _Shutdown | _MeasureTax

#: The code of a shutdown the daemon asked for (SIGTERM, SIGINT); any other code means it is gone.
SHUTDOWN = "shutdown"


def job_to_wire(job: Job) -> dict[str, Any]:
    """A job as a msgpack-able map (to an engine process, and in a plan to the other ranks)."""
    return {**asdict(job), "sampling": asdict(job.sampling), "stop_token_ids": list(job.stop_token_ids)}


def job_from_wire(d: dict[str, Any]) -> Job:
    return Job(**{**d, "sampling": SamplingParams(**d["sampling"]), "stop_token_ids": tuple(d["stop_token_ids"])})


def command_to_wire(cmd: _Command) -> dict[str, Any]:
    """A command as a plan carries it to the other ranks (the engine process's command form)."""
    if isinstance(cmd, _Submit):
        return {"c": "submit", "job": job_to_wire(cmd.job)}
    if isinstance(cmd, _Cancel):
        return {"c": "cancel", "seq": cmd.seq, "reason": cmd.reason, "code": cmd.code, "message": cmd.message}
    if isinstance(cmd, _Pause):
        return {"c": "pause", "seq": cmd.seq}
    if isinstance(cmd, _Resume):
        return {"c": "resume", "seq": cmd.seq}
    if isinstance(cmd, _Shutdown):
        return {"c": "shutdown", "reason": cmd.reason, "code": cmd.code, "message": cmd.message}
    return {"c": "measure_tax"}


def command_from_wire(d: dict[str, Any]) -> _Command:
    kind = d["c"]
    if kind == "submit":
        return _Submit(job_from_wire(d["job"]))
    if kind == "cancel":
        return _Cancel(d["seq"], d["reason"], d["code"], d["message"])
    if kind == "pause":
        return _Pause(d["seq"])
    if kind == "resume":
        return _Resume(d["seq"])
    if kind == "shutdown":
        return _Shutdown(d["reason"], d["code"], d["message"])
    if kind == "measure_tax":
        return _MeasureTax()
    raise DistributedError(f"a plan carried an unknown command {kind!r}; the ranks run different versions")


def with_seed(job: Job) -> Job:
    """``job`` with a seed drawn now when it samples without one: the draw is made once, by the
    process that decides (rank 0), so every rank samples the same tokens."""
    if is_greedy(job.sampling) or job.sampling.seed is not None:
        return job
    return replace(job, sampling=replace(job.sampling, seed=secrets.randbits(63)))


@dataclass
class EngineSettings:
    max_batch: int = 32
    prefill_batch: int = 8
    prefill_step: int = 2048
    pin_scope: PinScope = "scoped"
    #: Probe the pairing at start-up for this many drafted tokens (verify width K + 1).
    probe_k: int | None = None
    drafter: str = "none"
    probe_policy: ProbePolicy = field(default_factory=ProbePolicy)
    #: ``--draft``: a draft model directory, ``demo`` or ``prompt-lookup``; ``--mtp``: an MTP head.
    draft: str | None = None
    mtp: str | None = None
    bursts: BurstSettings = field(default_factory=BurstSettings)
    #: Seconds between measurements of the pin's tax on batched decode (0 = only on demand).
    tax_interval_s: float = 300.0
    #: A measurement asked for sooner than this after the last one is skipped (its figure stands):
    #: each one stalls serving for a few forwards, so clients must not be able to queue them.
    tax_min_interval_s: float = 30.0
    #: Bytes of freed buffers MLX may keep for reuse (``mx.set_cache_limit``); ``None`` keeps MLX's
    #: default. Whatever the limit, the cache is emptied whenever the engine goes idle.
    mlx_cache_limit_bytes: int | None = None
    #: Bytes of KV the prefix cache may keep (LRU eviction); 0 (the default) turns it off and skips its
    #: start-up check. It serves when ``warm_vs_cold`` finds reuse exact, or under ``allow_inexact``.
    prefix_cache_bytes: int = 0
    #: Across ranks: seconds one engine iteration may take before this rank presumes a peer gone and
    #: exits (mlx's ring can leave a collective waiting for good when its peer dies mid-transfer).
    rank_timeout_s: float = 60.0


def warm_up(engine: Engine) -> None:
    """Run one tiny job through the engine so the first client does not pay for lazy setup."""
    engine.submit(Job(seq=-1, prompt=[0, 0], max_tokens=2))
    while engine.has_work:
        engine.step()


def release_thread_streams() -> None:
    """Wait for this thread's MLX work and destroy its streams (call last on a thread that used MLX)."""
    try:
        mx.synchronize()
        mx.clear_streams()
    except Exception:  # a thread that died of an MLX error must still get to report it
        log.exception("could not release this thread's MLX streams")


class EngineThread:
    """Runs ``load`` then the engine loop on a dedicated thread.

    Across ranks (``world`` of several, or a callable that joins the group on the engine thread)
    every rank runs one, each on its shard of the model. Rank 0's decides every iteration
    (``_decide``: the commands taken, the clock-driven choices) and publishes it as a ``Plan``; every
    rank applies the plans in order (``_apply``), so all of them run the same forwards. Only rank 0
    has an inbox and a front end; the others' events are dropped (``emit`` of a follower)."""

    def __init__(
        self,
        load: Callable[[], LoadedModel],
        emit: Callable[[list[Signal]], None],
        settings: EngineSettings | None = None,
        world: World | Callable[[], World] | None = None,
    ) -> None:
        self._load = load
        self._emit = emit
        self._settings = settings or EngineSettings()
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlx-batchd-engine", daemon=True)
        self._engine: Engine | None = None
        self._tax_at = time.monotonic()
        self._tax_measured_at: float | None = None
        #: MLX has cached buffers from work since the engine was last idle.
        self._cache_dirty = False
        self._join_world = world if callable(world) and not isinstance(world, World) else None
        #: This process's place among the ranks (``load`` reads it once the engine thread joined).
        self.world = world if isinstance(world, World) else World.single()
        self._lockstep = Lockstep(self.world)
        self._shard_mode: Mode = "none"
        #: Across ranks: a digest of every token and end this rank's engine produced, compared with
        #: rank 0's before each plan (``_state``), so ranks that drifted apart stop instead of serving.
        self._digest = b""
        #: When the iteration in progress began (``None`` while rank 0 waits for commands).
        self._busy_since: float | None = None

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # Commands: safe from any thread, never block.
    def submit(self, job: Job) -> None:
        self._inbox.put(_Submit(job))

    def cancel(self, seq: int, reason: str = "cancelled", code: str | None = None, message: str | None = None) -> None:
        self._inbox.put(_Cancel(seq, reason, code, message))

    def pause(self, seq: int) -> None:
        """Stop producing tokens for ``seq`` (it keeps its cache) until ``resume``; see ``Engine.pause``."""
        self._inbox.put(_Pause(seq))

    def resume(self, seq: int) -> None:
        """Let a paused ``seq`` produce tokens again; unknown or finished sequences are ignored."""
        self._inbox.put(_Resume(seq))

    def measure_tax(self) -> None:
        """Time a batched step pinned vs wide at the current batch size, at the next step.

        Requests in one inbox drain run one measurement, and one within ``tax_min_interval_s`` of
        the last measurement is ignored (the snapshot keeps the last figure)."""
        self._inbox.put(_MeasureTax())

    def shutdown(
        self, reason: str = "error", code: str = "shutdown", message: str = "the daemon is shutting down"
    ) -> None:
        self._inbox.put(_Shutdown(reason, code, message))

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        final = self._serve()
        # Release this thread's MLX state before saying we are done: once ``Stopped`` is out the main
        # thread may finalize the interpreter, and MLX streams (and their worker threads) torn down by
        # exit-time destructors instead abort the process ("terminate called without an active
        # exception"). MLX asks every thread that used it to call ``clear_streams`` at its end.
        self._engine = None
        release_thread_streams()
        self._emit([final])

    def _serve(self) -> Stopped | Dead:
        """Load, warm up, announce ``Ready`` and run the loop; the final signal is the caller's to send."""
        try:
            s = self._settings
            if self._join_world is not None:
                self.world = self._join_world()
                self._lockstep = Lockstep(self.world)
            if self.world.distributed:
                check_same_settings(self.world, s)
            if s.mlx_cache_limit_bytes is not None:
                mx.set_cache_limit(s.mlx_cache_limit_bytes)
            loaded = self._load()
            if loaded.shard is not None:
                self._shard_mode = loaded.shard.mode
            engine = Engine(
                loaded.model,
                eos_token_ids=loaded.info.eos_token_ids,
                vocab_size=loaded.info.vocab_size,
                max_batch=s.max_batch,
                prefill_batch=s.prefill_batch,
                prefill_step=s.prefill_step,
                pin_scope=s.pin_scope,
                lockstep=self.world.distributed,
            )
            warm_up(engine)
            if s.prefix_cache_bytes > 0:
                configure_prefix_cache(engine, loaded, s)
            if s.draft is not None or s.mtp is not None:
                configure_bursts(engine, loaded, s, self.world)
            elif s.probe_k is not None:
                start_probe(engine, loaded, s, s.drafter, s.probe_k, self.world)
            engine.reset_counters()
        except (ModelError, DistributedError) as exc:  # a model or set-up that cannot serve: one line
            return Dead(str(exc))
        except Exception as exc:
            return Dead(self._failure(exc))
        self._engine = engine
        if self.world.distributed and self.world.leader:
            w = self.world
            log.info("%d ranks, %s, %s (model %s)", w.size, w.backend, self._shard_mode, loaded.info.name)
        self._emit([Ready(loaded.info, loaded.tokenizer)])
        if self.world.distributed and s.rank_timeout_s > 0:
            watchdog = threading.Thread(target=self._watch, name="mlx-batchd-rank-watchdog", daemon=True)
            watchdog.start()
        try:
            if self.world.leader:
                self._lead(engine)
            else:
                self._follow(engine)
        except DistributedError as exc:
            return Dead(str(exc))
        except Exception as exc:
            return Dead(self._failure(exc))
        return Stopped()

    def _failure(self, exc: BaseException) -> str:
        """What ``Dead`` says: one line when a peer is gone (the usual end of a rank whose partner
        died inside a forward), else the traceback."""
        lost = as_peer_lost(self.world, exc)
        return str(lost) if lost is not None else traceback.format_exc()

    def _watch(self) -> None:
        """End this process when one iteration runs past ``rank_timeout_s``.

        A ring collective whose peer died mid-transfer can wait for good (its promise is never
        kept), with nothing raised: the engine thread cannot notice, and the daemon would hold
        every request open. The rank says why (``Dead``, and in its log) and exits 1; the others
        then lose their peer in turn."""
        limit = self._settings.rank_timeout_s
        while self._thread.is_alive():
            time.sleep(min(1.0, limit / 4))
            since = self._busy_since
            if since is None or time.monotonic() - since <= limit:
                continue
            why = (
                f"rank {self.world.rank}: one engine iteration ran past --rank-timeout {limit:g} s; "
                "a peer is gone or stuck inside a collective, so this rank stops"
            )
            log.error("%s", why)
            self._emit([Dead(why)])
            time.sleep(1.0)  # the word leaves with the engine process's socket
            os._exit(1)

    def _commands(self, block: bool) -> list[_Command]:
        """The inbox's commands; when ``block``, the first is waited for (across ranks for at most
        ``IDLE_WAIT_S``: the other ranks wait inside the next plan's collective meanwhile)."""
        cmds: list[_Command] = []
        if block:
            if not self.world.distributed:
                cmds.append(self._inbox.get())
            else:
                try:
                    cmds.append(self._inbox.get(timeout=IDLE_WAIT_S))
                except queue.Empty:
                    return cmds
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _lead(self, engine: Engine) -> None:
        """Rank 0's loop (the only one without other ranks): decide, publish, apply."""
        for iteration in itertools.count():
            faults.check_loop(iteration)
            idle = not engine.has_work and not engine.probing
            if idle and self._cache_dirty:
                self._release_cache()
            self._busy_since = None
            cmds = self._commands(block=idle)
            self._busy_since = time.monotonic()
            if self._apply(engine, self._decide(engine, cmds, idle)):
                return

    def _follow(self, engine: Engine) -> None:
        """Another rank's loop: rank 0's plans, each checked against this rank's state, then applied."""

        def apply(plan: Plan) -> None:
            want, have = plan.decisions.get("check"), self._state(engine)
            if want != have:
                raise DistributedError(
                    f"rank {self.world.rank} diverged from rank 0 before plan {plan.iteration} "
                    f"(rank 0: {want}, rank {self.world.rank}: {have}); stopping every rank"
                )
            self._apply(engine, plan)
            if self._cache_dirty and not engine.has_work and not engine.probing:
                self._release_cache()

        while True:
            self._busy_since = time.monotonic()
            plan = self._lockstep.receive()
            if not plan.stop:
                apply(plan)
                continue
            code = plan.decisions.get("stop", SHUTDOWN)
            if code != SHUTDOWN:  # rank 0's engine stopped because its daemon is gone, not asked to
                raise DistributedError(f"rank 0 stopped every rank ({code}); its daemon is gone")
            return

    def _decide(self, engine: Engine, cmds: list[_Command], idle: bool) -> Plan:
        """This iteration as rank 0 decides it: the commands in wire form (unseeded sampled jobs get
        their seed here), and every choice that reads the clock, published to the other ranks."""
        wire: list[dict[str, Any]] = []
        tax_asked = False
        stop: str | None = None
        for cmd in cmds:
            if isinstance(cmd, _MeasureTax):
                tax_asked = True
                continue
            if isinstance(cmd, _Submit):
                cmd = _Submit(with_seed(cmd.job))
            wire.append(command_to_wire(cmd))
            if isinstance(cmd, _Shutdown):
                stop = cmd.code
                break
        gate = engine.runner.gate(time.perf_counter())
        decisions: dict[str, Any] = {"gate": [gate.refusal, gate.stop], "tax": self._tax_due(tax_asked)}
        if stop:
            decisions["stop"] = stop
        distributed = self.world.distributed
        if distributed:
            decisions["check"] = self._state(engine)
        # Only an idle tick says the next plan is a wait away: followers then sleep instead of spinning.
        wait_s = IDLE_WAIT_S if distributed and idle and not wire else 0.0
        return self._lockstep.publish(wire, decisions, wait_s, stop is not None)

    def _apply(self, engine: Engine, plan: Plan) -> bool:
        """Apply one plan (every rank the same); ``True`` once a shutdown was applied."""
        events: list[Signal] = []
        for wire in plan.commands:
            cmd = command_from_wire(wire)
            if isinstance(cmd, _Submit):
                engine.submit(cmd.job)
            elif isinstance(cmd, _Cancel):
                events += engine.cancel(cmd.seq, cmd.reason, cmd.code, cmd.message)
            elif isinstance(cmd, _Pause):
                events += engine.pause(cmd.seq)
            elif isinstance(cmd, _Resume):
                events += engine.resume(cmd.seq)
            elif isinstance(cmd, _Shutdown):
                events += engine.cancel_all(cmd.reason, cmd.code, cmd.message)
                if events:
                    self._emit(events)
                return True
        if plan.decisions.get("tax"):
            self._measure_tax(engine)
        if engine.has_work:
            self._cache_dirty = True
            refusal, stop = plan.decisions["gate"]
            events += engine.step(Gate(refusal, stop))
        if events:
            self._emit(events)
            if self.world.distributed:
                self._note(events)
        # The probe runs a draw at a time, only while the engine is idle, so serving never
        # waits for it (a request arriving mid-draw waits for that one draw at most).
        if engine.probing and not engine.has_work:
            self._cache_dirty = True
            engine.probe_step()
        return False

    def _tax_due(self, asked: bool) -> bool:
        """Whether to measure the pin's tax this iteration: asked for and the last measurement is
        older than ``tax_min_interval_s``, or ``tax_interval_s`` has passed since the last one."""
        s, now = self._settings, time.monotonic()
        if asked:
            last = self._tax_measured_at
            if last is None or now - last >= s.tax_min_interval_s:
                return True
            log.debug("pin tax measurement skipped: the last one is under %.0f s old", s.tax_min_interval_s)
        return bool(s.tax_interval_s) and now - self._tax_at > s.tax_interval_s

    def _note(self, events: list[Signal]) -> None:
        """Fold this iteration's tokens and ends into the digest ``_state`` compares across ranks."""
        h = hashlib.blake2b(self._digest, digest_size=8)
        for e in events:
            if isinstance(e, Tokens):
                h.update(msgpack.packb([e.seq, e.tokens]))
            elif isinstance(e, Finished):
                h.update(msgpack.packb([e.seq, str(e.reason)]))
        self._digest = h.digest()

    def _state(self, engine: Engine) -> list[Any]:
        """What every rank's engine must agree on between plans (lists only: it crosses msgpack)."""
        verdicts = [[name, v.level] for name, v in sorted(engine.verdicts.items())]
        bursting = engine.runner.current is not None
        return [engine.active, engine.batch_size(), bursting, engine.probing, verdicts, self._digest.hex()]

    def _release_cache(self) -> None:
        """Give MLX's cached buffers back while nothing runs. They are the engine's own peak, kept
        for reuse; on a GPU shared with other processes (other daemons, a benchmark) they are
        memory those processes cannot have, and a daemon that had served large batches once kept
        them for good. Emptying costs nothing while idle and the next step re-allocates."""
        mx.clear_cache()
        self._cache_dirty = False

    def _measure_tax(self, engine: Engine) -> None:
        """At the verdict's level when it pins, else at narrow (what a pin would cost). Across ranks
        a failure stops every rank: the measurement's forwards hold collectives."""
        self._tax_at = self._tax_measured_at = time.monotonic()
        level = Level.NARROW
        for v in engine.verdicts.values():
            if v.level not in (None, Level.WIDE.value):
                level = Level(v.level)
        try:
            engine.measure_tax(max(2, engine.batch_size()), level)
        except Exception:
            if self.world.distributed:
                raise
            log.exception("pin tax measurement failed")

    def snapshot(self) -> dict[str, Any]:
        """``engine_snapshot`` as the engine handle passes it on (``{}`` before the engine is
        ready): a plain map, the type ``scheduler.engine_process.EngineHandle`` declares."""
        snap = self.engine_snapshot()
        return {} if snap is None else dict(snap)

    def distributed_snapshot(self) -> DistributedSnapshot:
        """Which ranks serve the model, over what, split how (one rank, ``single``, unsplit alone)."""
        w = self.world
        return {"world_size": w.size, "rank": w.rank, "backend": w.backend, "mode": self._shard_mode}

    def engine_snapshot(self) -> EngineSnapshot | None:
        """Counters and gauges for the stats reply (``stats.engine``), read from any thread; ``None``
        before the engine is ready.

        The engine thread only ever replaces these ints and lengths, and reading them is atomic
        under the GIL, so no lock is taken on the hot path. The engine's parts return plain maps;
        each is cast to its part of the contract (``workers.snapshot``) here.
        """
        engine = self._engine
        if engine is None:
            return None
        return {
            **engine.counters.snapshot(),
            "active_sequences": engine.active,
            "paused": engine.paused,
            "batch_size": engine.batch_size(),
            "pin_scope": engine.pin_scope,
            "pins": cast(PinsSnapshot, engine.ledger.snapshot()),
            "verdicts": cast(dict[str, VerdictRow | ProbingRow], engine.verdict_summary()),
            "bursts": cast(BurstSummary, engine.burst_summary()),
            "pin_tax": cast(PinTax, engine.tax_summary()),
            "prefix_cache": {"enabled": False}
            if engine.prefix_cache is None
            else cast(PrefixCacheSnapshot, engine.prefix_cache.snapshot()),
            "memory": {
                "active_bytes": mx.get_active_memory(),
                "cache_bytes": mx.get_cache_memory(),
                "peak_bytes": mx.get_peak_memory(),
            },
            "distributed": self.distributed_snapshot(),
        }


def check_same_settings(world: World, settings: EngineSettings) -> None:
    """Every rank must run the engine with rank 0's options (batch sizes, drafter, probe): they
    decide which forwards run. A rank started with other options stops every rank, in one line."""
    text = json.dumps(asdict(settings), sort_keys=True, default=str).encode()
    check_same(
        world,
        hashlib.blake2b(text, digest_size=16).digest(),
        "engine options",
        "start every rank with the same serve options",
    )


class RankZeroStore(VerdictStore):
    """The verdict store as every rank sees it: rank 0 reads its own and broadcasts what it found
    (or that it found nothing), the others take that; only rank 0 writes. A probe that one rank
    skipped on a stored verdict while another ran it would leave the two in different forwards."""

    def __init__(self, inner: VerdictStore | None, world: World) -> None:
        super().__init__(inner.root if inner is not None else Path("."))
        self._inner = inner
        self._world = world
        self._broadcast = Broadcaster(world)

    def get(self, fingerprint: str) -> Verdict | None:
        if self._world.leader:
            found = None if self._inner is None else self._inner.get(fingerprint)
            self._broadcast(None if found is None else json.dumps(found.to_json()))
            return found
        data = self._broadcast()
        if data is None:
            return None
        try:
            verdict = Verdict.from_json(json.loads(data))
        except ValueError as exc:
            raise DistributedError(
                f"rank {self._world.rank}: rank 0's stored verdict does not read here: {exc}"
            ) from None
        verdict.from_cache = True
        return verdict

    def put(self, verdict: Verdict) -> None:
        if self._world.leader and self._inner is not None:
            self._inner.put(verdict)


def start_probe(
    engine: Engine, loaded: LoadedModel, s: EngineSettings, drafter: str, k: int, world: World | None = None
) -> str:
    """Queue the start-up probe for a pairing (memoised on disk by fingerprint); return its name.

    Across ranks the verdict is per world: the pairing includes the world size, backend and split,
    rank 0's store answers for every rank (``RankZeroStore``), and only rank 0 fingerprints the
    model (two ranks on one machine would otherwise write the same memo file at once)."""
    name = f"{loaded.info.name}+{drafter} k={k}"
    if world is None or not world.distributed:
        setup = probe_setup(loaded, drafter)
    else:
        setup = probe_setup(loaded, drafter) if world.leader else _follower_probe_setup(loaded)
        mode = "none" if loaded.shard is None else loaded.shard.mode
        split = {"world_size": world.size, "backend": world.backend, "mode": mode}
        setup = replace(setup, pairing={**setup.pairing, "distributed": split}, store=RankZeroStore(setup.store, world))
    engine.start_probe(name, setup.steps(engine.counted, k, s.probe_policy))
    return name


def _follower_probe_setup(loaded: LoadedModel) -> ProbeSetup:
    """A rank other than 0's probe set-up: the same caches and draws, no pairing of its own (rank
    0's store answers, ``RankZeroStore``)."""
    from mlx_lm.models.cache import make_prompt_cache

    def make_cache() -> list[Any]:
        return make_prompt_cache(loaded.model)

    return ProbeSetup(
        make_cache=make_cache,
        pairing={"rank_of_several": True},
        store=None,
        vocab_size=loaded.info.vocab_size,
        context_length=loaded.info.context_length,
        window=sliding_window(loaded.config),
    )


def configure_bursts(engine: Engine, loaded: LoadedModel, s: EngineSettings, world: World | None = None) -> None:
    """Load the drafter, check it fits the target, and probe the pairing in the background."""
    from workers.drafters import load_drafter, load_mtp_drafter

    if s.mtp is not None:
        drafter = load_mtp_drafter(s.mtp, loaded.model)
    else:
        assert s.draft is not None
        drafter = load_drafter(s.draft, loaded.model, loaded.info.vocab_size)
    name = start_probe(engine, loaded, s, drafter.name, s.bursts.k, world)
    engine.configure_bursts(drafter, s.bursts, name)


def configure_prefix_cache(engine: Engine, loaded: LoadedModel, s: EngineSettings) -> None:
    """Check warm-vs-cold reuse on the loaded model (once, before ``Ready``) and install the cache.
    Not across ranks: which prompts hit is decided per rank by its own cache's bytes and evictions."""
    if loaded.shard is not None:
        raise DistributedError("--prefix-cache-mb cannot serve across ranks yet; leave it at 0 under mlx.launch")
    from workers.pins import unpinned
    from workers.prefix_cache import checked

    with unpinned("probe"):
        engine.prefix_cache = checked(
            engine.counted,
            s.prefix_cache_bytes,
            prefill_step=s.prefill_step,
            vocab_size=loaded.info.vocab_size,
            window=sliding_window(loaded.config),
            context=loaded.info.context_length,
            allow_inexact=s.probe_policy.allow_inexact,
        )
