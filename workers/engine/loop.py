"""The engine thread: the one owner of the engine loop and of every MLX object.

Commands come in through a thread-safe inbox and never wait on anything; events go out through
an ``emit`` callback the caller supplies (the daemon hands them to its event loop). The loop
blocks only when it has nothing to decode, so network I/O never stalls a decode step, and a
decode step never stalls the network.

Lifecycle, as in vLLM's engine core: ``Ready`` once the model is loaded and warmed up, then
events, then ``Stopped`` after a shutdown, or ``Dead`` if the loop itself failed. Start-up work not
done by ``Ready`` (kernel plans and the prefix cache's check not stored yet, the probe) runs a unit
at a time while the engine is idle (``Engine.start_up_step``).

One model over several ranks (docs/distributed.md) runs one of these per rank: each iteration is
decided by rank 0 (``_decide``: the commands, seeds for unseeded sampled jobs, every choice that
reads the clock) and published as a ``workers.dist.Plan``; every rank applies the plans with
the same code (``_apply``), so all run the same forwards, and each follower checks rank 0's state
in the plan against its own before applying it (``workers.engine.ranks``: a follower's loop, the
digest the ranks compare, the watchdog).

Its vocabulary (commands, signals) is ``workers.api``; building the engine it serves is
``workers.engine.startup``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from workers.api import (
    Cancel,
    Command,
    Dead,
    EngineSettings,
    Job,
    Pause,
    Ready,
    Resume,
    Shutdown,
    Signal,
    Stopped,
    SubmitJob,
)
from workers.api.stats import (
    AdmissionSnapshot,
    DistributedSnapshot,
    EngineNotReady,
    EnginePart,
    EngineSnapshot,
    LoopSnapshot,
)
from workers.dist import IDLE_WAIT_S, DistributedError, Lockstep, Mode, Plan, World, as_peer_lost
from workers.engine import faults
from workers.engine.arrivals import AdmissionWaves
from workers.engine.engine import Engine
from workers.engine.prefill_wave import most_prompts
from workers.engine.profiling import profiled
from workers.engine.ranks import Ranks
from workers.engine.ready_phases import PhaseClock, timed_load
from workers.engine.sampling import with_seed
from workers.engine.spec.policy import Gate
from workers.engine.startup import buffer_cache_limit, build_engine, check_environment, check_same_settings
from workers.engine.stats import engine_snapshot
from workers.engine.thread_clock import thread_cpus
from workers.kernels import SettingError, configure_attention
from workers.models import LoadedModel, ModelError

log = logging.getLogger("mlx_batchd.engine")

#: The most of a busy engine's time the start-up pieces before the probe may take (their units run
#: between steps, so a unit delays the batch's next token by its length).
START_UP_SHARE = 0.05
#: Seconds without work or commands before an idle engine runs start-up units: the gap between a
#: client's requests that follow each other is not idle time (a unit there delays the next request).
START_UP_QUIET_S = 1.0


def release_thread_streams() -> None:
    """Wait for this thread's MLX work and destroy its streams (call last on a thread that used MLX)."""
    try:
        mx.synchronize()
        mx.clear_streams()
    except Exception:  # a thread that died of an MLX error must still get to report it
        log.exception("could not release this thread's MLX streams")


class EngineThread(Ranks):
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
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlx-batchd-engine", daemon=True)
        self._engine: Engine | None = None
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
        #: Start-up pieces (kernel plans, the prefix check) run while the engine is busy too, at most
        #: ``START_UP_SHARE`` of its time: when the engine first had work with pieces pending, and
        #: the seconds of the units run since then while it had work.
        self._start_up_since: float | None = None
        self._start_up_spent = 0.0
        #: When rank 0 last had work or a command (idle start-up units wait ``START_UP_QUIET_S`` after it).
        self._last_work = time.monotonic()
        #: Iterations of the loop, and the seconds its ``emit`` calls took (``loop_snapshot``).
        self._iterations = 0
        self._emit_seconds = 0.0
        self._native_id: int | None = None  # the engine thread's OS id, once it runs
        #: Rank 0 holds arrivals that land mid-batch so that they join in prefill waves.
        s = self._settings
        self._admission = AdmissionWaves(
            most_prompts(s.prefill_batch, s.max_batch), s.admit_window_s, s.admit_idle_window_s
        )

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # Commands: safe from any thread, never block.
    def command(self, cmd: Command) -> None:
        """Any command, as the engine process receives them from the daemon."""
        self._inbox.put(cmd)

    def submit(self, job: Job) -> None:
        self._inbox.put(SubmitJob(job))

    def cancel(self, seq: int, reason: str = "cancelled", code: str | None = None, message: str | None = None) -> None:
        self._inbox.put(Cancel(seq, reason, code, message))

    def pause(self, seq: int) -> None:
        """Stop producing tokens for ``seq`` (it keeps its cache) until ``resume``; see ``Engine.pause``."""
        self._inbox.put(Pause(seq))

    def resume(self, seq: int) -> None:
        """Let a paused ``seq`` produce tokens again; unknown or finished sequences are ignored."""
        self._inbox.put(Resume(seq))

    def shutdown(
        self, reason: str = "error", code: str = "shutdown", message: str = "the daemon is shutting down"
    ) -> None:
        self._inbox.put(Shutdown(reason, code, message))

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        self._native_id = threading.get_native_id()
        with profiled("engine"):
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
        clock = PhaseClock()
        try:
            s = self._settings
            with clock.phase("set-up"):
                if self._join_world is not None:
                    self.world = self._join_world()
                    self._lockstep = Lockstep(self.world)
                if self.world.distributed:
                    check_same_settings(self.world, s)
                check_environment()
                mx.set_cache_limit(buffer_cache_limit(s))
                configure_attention(s.cudnn_attention)
            loaded = timed_load(clock, self._load)
            if loaded.shard is not None:
                self._shard_mode = loaded.shard.mode
            engine = build_engine(loaded, s, self.world, clock)
        except (ModelError, DistributedError, SettingError) as exc:  # a model or set-up that cannot serve: one line
            return Dead(str(exc))
        except Exception as exc:
            return Dead(self._failure(exc))
        self._engine = engine
        engine.ready_phases = dict(clock.seconds)
        if self.world.leader:
            log.info("%s", clock.line())
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

    def _commands(self, block: bool, timeout: float | None = None) -> list[Command]:
        """The inbox's commands; when ``block``, the first is waited for (for at most ``timeout``, and
        across ranks for at most ``IDLE_WAIT_S``: the other ranks wait inside the next plan's
        collective meanwhile)."""
        cmds: list[Command] = []
        if block:
            if self.world.distributed:
                timeout = IDLE_WAIT_S if timeout is None else min(timeout, IDLE_WAIT_S)
            try:
                cmds.append(self._inbox.get(timeout=timeout))
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
            idle = not engine.has_work and not engine.starting and not self._admission.held
            if idle and self._cache_dirty:
                self._release_cache()
            self._busy_since = None
            # With arrivals held for an idle engine's window, wait for more until they are due; with
            # start-up work pending, wait out the quiet before its next idle unit.
            holding = self._admission.wait_s(time.monotonic()) if not engine.has_work else None
            quiet = self._quiet_s(engine)
            if quiet is not None and quiet > 0:
                holding = quiet if holding is None else min(holding, quiet)
            cmds = self._commands(block=idle or holding is not None, timeout=holding)
            self._busy_since = time.monotonic()
            if cmds or engine.has_work:
                self._last_work = self._busy_since
            if self._apply(engine, self._decide(engine, cmds, idle)):
                return

    def _quiet_s(self, engine: Engine) -> float | None:
        """With start-up work pending on an engine without work: the seconds of quiet still to wait
        before its next idle unit (0 or less: due now); ``None`` otherwise."""
        if not engine.starting or engine.has_work or self._admission.held:
            return None
        return START_UP_QUIET_S - (time.monotonic() - self._last_work)

    def _decide(self, engine: Engine, cmds: list[Command], idle: bool) -> Plan:
        """This iteration as rank 0 decides it: the commands (unseeded sampled jobs get their seed
        here), and every choice that reads the clock, published to the other ranks (as plain maps only
        where there are other ranks: ``Lockstep.publish``)."""
        plain: list[Command] = []
        stop: str | None = None
        for cmd in self._admission.take(cmds, engine.has_work, time.monotonic()):
            if isinstance(cmd, SubmitJob):
                cmd = SubmitJob(with_seed(cmd.job))
            plain.append(cmd)
            if isinstance(cmd, Shutdown):
                stop = cmd.code
                break
        gate = engine.runner.gate(time.perf_counter())
        decisions: dict[str, Any] = {"gate": [gate.refusal, gate.stop]}
        if self._start_up_due(engine):
            decisions["start_up"] = True
        quiet = self._quiet_s(engine)
        if not plain and quiet is not None and quiet <= 0:
            decisions["idle_start_up"] = True
        if stop:
            decisions["stop"] = stop
        distributed = self.world.distributed
        if distributed:
            decisions["check"] = self._state(engine)
        # Only an idle tick says the next plan is a wait away: followers then sleep instead of spinning.
        wait_s = IDLE_WAIT_S if distributed and idle and not plain else 0.0
        return self._lockstep.publish(plain, decisions, wait_s, stop is not None)

    def _apply(self, engine: Engine, plan: Plan) -> bool:
        """Apply one plan (every rank the same); ``True`` once a shutdown was applied."""
        events: list[Signal] = []
        for cmd in plan.commands:
            if isinstance(cmd, SubmitJob):
                engine.submit(cmd.job)
            elif isinstance(cmd, Cancel):
                events += engine.cancel(cmd.seq, cmd.reason, cmd.code, cmd.message)
            elif isinstance(cmd, Pause):
                events += engine.pause(cmd.seq)
            elif isinstance(cmd, Resume):
                events += engine.resume(cmd.seq)
            elif isinstance(cmd, Shutdown):
                events += engine.cancel_all(cmd.reason, cmd.code, cmd.message)
                if events:
                    self._emit(events)
                return True
        if engine.has_work:
            self._cache_dirty = True
            refusal, stop = plan.decisions["gate"]
            events += engine.step(Gate(refusal, stop))
        self._iterations += 1
        if events:
            tic = time.perf_counter()
            self._emit(events)
            self._emit_seconds += time.perf_counter() - tic
            if self.world.distributed:
                self._note(events)
        # Start-up work (plans, the prefix check, then the probe) runs a unit at a time once the engine
        # has been quiet for START_UP_QUIET_S, and the pieces before the probe also while busy, within their share.
        if plan.decisions.get("idle_start_up") and engine.starting and not engine.has_work:
            self._cache_dirty = True
            engine.start_up_step()
        elif plan.decisions.get("start_up") and engine.background.pending:
            tic = time.monotonic()
            engine.background.step()
            self._start_up_spent += time.monotonic() - tic
        return False

    def _start_up_due(self, engine: Engine) -> bool:
        """Whether a busy iteration also runs a start-up piece's unit: so that a daemon busy from its
        start still gets its kernel plans and prefix cache, at most ``START_UP_SHARE`` of the engine's
        time from when it first had work with pieces pending. The probe stays idle-only: its bursts
        serve a lone sequence."""
        if not (engine.background.pending and engine.has_work):
            return False
        now = time.monotonic()
        if self._start_up_since is None:
            self._start_up_since = now
        return self._start_up_spent < START_UP_SHARE * (now - self._start_up_since)

    def _release_cache(self) -> None:
        """Give MLX's cached buffers (the engine's own peak) back while nothing runs: on a shared GPU
        they are memory other processes cannot have; the next step re-allocates."""
        mx.clear_cache()
        self._cache_dirty = False

    def snapshot(self) -> EnginePart:
        """``engine_snapshot`` as the engine handle passes it on (the empty map before the engine
        is ready)."""
        snap = self.engine_snapshot()
        return EngineNotReady() if snap is None else snap

    def distributed_snapshot(self) -> DistributedSnapshot:
        """Which ranks serve the model, over what, split how (one rank, ``single``, unsplit alone)."""
        w = self.world
        return {"world_size": w.size, "rank": w.rank, "backend": w.backend, "mode": self._shard_mode}

    def engine_snapshot(self) -> EngineSnapshot | None:
        """Counters and gauges for the stats reply (``stats.engine``), read from any thread; ``None``
        before the engine is ready (``workers.engine.stats`` says why no lock is taken)."""
        engine = self._engine
        return (
            None
            if engine is None
            else engine_snapshot(engine, self.distributed_snapshot(), self.admission_snapshot(), self.loop_snapshot())
        )

    def loop_snapshot(self) -> LoopSnapshot:
        return {
            "iterations": self._iterations,
            "emit_seconds": self._emit_seconds,
            "cpus": thread_cpus(self._native_id),
        }

    def admission_snapshot(self) -> AdmissionSnapshot:
        a = self._admission
        return {
            "window_ms": 1e3 * a.window_s,
            "idle_window_ms": 1e3 * a.idle_window_s,
            "held": len(a.held),
            "delayed": a.delayed,
            "idle_hold_seconds": a.idle_hold_seconds,
        }
