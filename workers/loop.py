"""The engine thread: the one owner of the engine loop and of every MLX object.

Commands come in through a thread-safe inbox and never wait on anything; events go out through
an ``emit`` callback the caller supplies (the daemon hands them to its event loop). The loop
blocks only when it has nothing to decode, so network I/O never stalls a decode step, and a
decode step never stalls the network.

Lifecycle, as in vLLM's engine core: ``Ready`` once the model is loaded and warmed up, then
events, then ``Stopped`` after a shutdown, or ``Dead`` if the loop itself failed.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx

from workers import faults
from workers.burst import BurstSettings
from workers.engine import Engine, Event, Job, PinScope
from workers.kernels import Level
from workers.models import LoadedModel, ModelError, ModelInfo
from workers.probe import ProbePolicy, sliding_window
from workers.probe_setup import probe_setup
from workers.snapshot import (
    BurstSummary,
    EngineSnapshot,
    PinsSnapshot,
    PinTax,
    PrefixCacheSnapshot,
    ProbingRow,
    VerdictRow,
)

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
    """Runs ``load`` then the engine loop on a dedicated thread."""

    def __init__(
        self,
        load: Callable[[], LoadedModel],
        emit: Callable[[list[Signal]], None],
        settings: EngineSettings | None = None,
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
            if s.mlx_cache_limit_bytes is not None:
                mx.set_cache_limit(s.mlx_cache_limit_bytes)
            loaded = self._load()
            engine = Engine(
                loaded.model,
                eos_token_ids=loaded.info.eos_token_ids,
                vocab_size=loaded.info.vocab_size,
                max_batch=s.max_batch,
                prefill_batch=s.prefill_batch,
                prefill_step=s.prefill_step,
                pin_scope=s.pin_scope,
            )
            warm_up(engine)
            if s.prefix_cache_bytes > 0:
                configure_prefix_cache(engine, loaded, s)
            if s.draft is not None or s.mtp is not None:
                configure_bursts(engine, loaded, s)
            elif s.probe_k is not None:
                start_probe(engine, loaded, s, s.drafter, s.probe_k)
            engine.reset_counters()
        except ModelError as exc:  # a model the user pointed at that cannot load: one line, no traceback
            return Dead(str(exc))
        except Exception:
            return Dead(traceback.format_exc())
        self._engine = engine
        self._emit([Ready(loaded.info, loaded.tokenizer)])
        try:
            self._loop(engine)
        except Exception:
            return Dead(traceback.format_exc())
        return Stopped()

    def _commands(self, block: bool) -> list[_Command]:
        cmds: list[_Command] = []
        if block:
            cmds.append(self._inbox.get())
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _loop(self, engine: Engine) -> None:
        for iteration in itertools.count():
            faults.check_loop(iteration)
            events: list[Signal] = []
            tax_asked = False
            idle = not engine.has_work and not engine.probing
            if idle and self._cache_dirty:
                self._release_cache()
            for cmd in self._commands(block=idle):
                if isinstance(cmd, _Submit):
                    engine.submit(cmd.job)
                elif isinstance(cmd, _Cancel):
                    events += engine.cancel(cmd.seq, cmd.reason, cmd.code, cmd.message)
                elif isinstance(cmd, _Pause):
                    events += engine.pause(cmd.seq)
                elif isinstance(cmd, _Resume):
                    events += engine.resume(cmd.seq)
                elif isinstance(cmd, _MeasureTax):
                    tax_asked = True
                else:
                    events += engine.cancel_all(cmd.reason, cmd.code, cmd.message)
                    if events:
                        self._emit(events)
                    return
            if tax_asked:
                self._measure_tax_on_demand(engine)
            if engine.has_work:
                self._cache_dirty = True
                events += engine.step()
            if events:
                self._emit(events)
            # The probe runs a draw at a time, only while the engine is idle, so serving never
            # waits for it (a request arriving mid-draw waits for that one draw at most).
            if engine.probing and not engine.has_work:
                self._cache_dirty = True
                engine.probe_step()
            if self._settings.tax_interval_s and time.monotonic() - self._tax_at > self._settings.tax_interval_s:
                self._measure_tax(engine)

    def _release_cache(self) -> None:
        """Give MLX's cached buffers back while nothing runs. They are the engine's own peak, kept
        for reuse; on a GPU shared with other processes (other daemons, a benchmark) they are
        memory those processes cannot have, and a daemon that had served large batches once kept
        them for good. Emptying costs nothing while idle and the next step re-allocates."""
        mx.clear_cache()
        self._cache_dirty = False

    def _measure_tax_on_demand(self, engine: Engine) -> None:
        """Measure unless the last measurement is more recent than ``tax_min_interval_s``."""
        last = self._tax_measured_at
        if last is not None and time.monotonic() - last < self._settings.tax_min_interval_s:
            log.debug(
                "pin tax measurement skipped: the last one is under %.0f s old", self._settings.tax_min_interval_s
            )
            return
        self._measure_tax(engine)

    def _measure_tax(self, engine: Engine) -> None:
        """At the verdict's level when it pins, else at narrow (what a pin would cost)."""
        self._tax_at = self._tax_measured_at = time.monotonic()
        level = Level.NARROW
        for v in engine.verdicts.values():
            if v.level not in (None, Level.WIDE.value):
                level = Level(v.level)
        try:
            engine.measure_tax(max(2, engine.batch_size()), level)
        except Exception:
            log.exception("pin tax measurement failed")

    def snapshot(self) -> dict[str, Any]:
        """``engine_snapshot`` as the engine handle passes it on (``{}`` before the engine is
        ready): a plain map, the type ``scheduler.engine_process.EngineHandle`` declares."""
        snap = self.engine_snapshot()
        return {} if snap is None else dict(snap)

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
        }


def start_probe(engine: Engine, loaded: LoadedModel, s: EngineSettings, drafter: str, k: int) -> str:
    """Queue the start-up probe for a pairing (memoised on disk by fingerprint); return its name."""
    name = f"{loaded.info.name}+{drafter} k={k}"
    engine.start_probe(name, probe_setup(loaded, drafter).steps(engine.counted, k, s.probe_policy))
    return name


def configure_bursts(engine: Engine, loaded: LoadedModel, s: EngineSettings) -> None:
    """Load the drafter, check it fits the target, and probe the pairing in the background."""
    from workers.drafters import load_drafter, load_mtp_drafter

    if s.mtp is not None:
        drafter = load_mtp_drafter(s.mtp, loaded.model)
    else:
        assert s.draft is not None
        drafter = load_drafter(s.draft, loaded.model, loaded.info.vocab_size)
    name = start_probe(engine, loaded, s, drafter.name, s.bursts.k)
    engine.configure_bursts(drafter, s.bursts, name)


def configure_prefix_cache(engine: Engine, loaded: LoadedModel, s: EngineSettings) -> None:
    """Check warm-vs-cold reuse on the loaded model (once, before ``Ready``) and install the cache."""
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
