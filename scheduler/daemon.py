"""Joining the pieces: a front end on anyio's asyncio backend and the engine in its own process."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio

from scheduler.affinity import AffinityError, CpuSplit, allowed_cpus, pin_process, plan_split
from scheduler.engine_process import EngineProcess
from scheduler.engine_spawn import Spawned
from scheduler.engine_watchdog import ENGINE_TIMEOUT_S
from scheduler.frontend import FrontEnd, FrontEndSettings
from workers import envs
from workers.api import EngineSettings, Signal

SWITCH_INTERVAL_S = 0.0005

log = logging.getLogger("mlx_batchd")


@dataclass(frozen=True)
class DaemonSettings:
    """What to serve (the model, the engine) and how (the front end's socket, limits, tenants)."""

    front: FrontEndSettings
    model: str = "demo"
    context_length: int | None = None
    engine: EngineSettings = field(default_factory=EngineSettings)
    #: ``split``: the front end and the engine process on CPUs of their own (``scheduler.affinity``);
    #: ``off``: the OS places both.
    cpu_affinity: str = "split"
    #: Seconds the engine process may owe work without a word before the daemon presumes it hung: every
    #: request ends ``engine_dead``, health says so, the daemon exits 1 (``engine_watchdog``; 0 = never).
    engine_timeout_s: float = ENGINE_TIMEOUT_S


def check_models(settings: DaemonSettings) -> None:
    """Refuse a model or drafter directory that cannot load (``ModelError``), before the socket is
    bound: the engine process loads them later, and a failure there would come after the daemon
    took its address, as a traceback in the log."""
    from workers.models.loading import ModelError, check_model

    check_model(settings.model)
    draft, mtp = settings.engine.draft, settings.engine.mtp
    if draft is not None and draft not in ("prompt-lookup", "demo"):
        check_model(draft, "--draft")
    if mtp is not None and mtp != "demo" and not (Path(mtp).expanduser() / "config.json").is_file():
        raise ModelError(f"--mtp {mtp!r} is not an MTP head directory (no config.json in it); pass one, or 'demo'")


def serve(settings: DaemonSettings, spawned: Spawned | None = None) -> int:
    """Run the daemon in this (main) thread until SIGINT/SIGTERM; return the exit code.

    A configuration that must not start raises (``ModelError``, ``SettingError``, ``ConfigError``,
    ``TenantsError``) before anything is bound; the command line turns those into one line.
    ``spawned``: the engine process, started before the front end's imports (``engine_spawn``);
    this call owns it, and ends it where the daemon does not start."""
    adopted = False
    try:
        envs.check()  # the engine process reads them; a typo is refused here, before anything is bound
        check_models(settings)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

        def make_engine(emit: Callable[[list[Signal]], None]) -> EngineProcess:
            # Called once the checks passed and the address is bound: a daemon that refuses to start
            # says one line, and moves nothing.
            nonlocal adopted
            split = place_processes(settings)
            cpus = None if split is None else split.engine
            engine = EngineProcess(
                settings.model,
                settings.context_length,
                emit,
                settings.engine,
                cpus,
                settings.engine_timeout_s,
                spawned,
            )
            adopted = True
            return engine

        return _run_front_end(settings, make_engine)
    finally:
        if spawned is not None and not adopted:
            spawned.discard()


def _run_front_end(
    settings: DaemonSettings, make_engine: Callable[[Callable[[list[Signal]], None]], EngineProcess]
) -> int:
    # The front end hands the engine at most one batch's worth of sequences at a time.
    front_settings = replace(
        settings.front, capacity=settings.engine.max_batch, prefix_cache_bytes=settings.engine.prefix_cache_bytes
    )
    front = FrontEnd(front_settings, make_engine)
    # The event loop shares the GIL with the engine process's receiver thread. A short switch
    # interval keeps the loop's bookkeeping from holding up the next batch of events by up to 5 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        return anyio.run(front.run, backend="asyncio")
    finally:
        if "mlx.core" in sys.modules:  # MLX asks every thread that used it, the main one too
            from workers.engine.loop import release_thread_streams

            release_thread_streams()


def place_processes(settings: DaemonSettings) -> CpuSplit | None:
    """Move this process (the front end) onto its share of the CPUs and return the split, whose
    ``engine`` part the engine process takes when it starts; ``None`` where nothing is split: turned
    off, ranks started by ``mlx.launch`` (their placement is
    the launcher's), fewer than two CPUs, or an OS that refuses."""
    from workers.dist import launched_size

    if settings.cpu_affinity == "off":
        return None
    size = launched_size(os.environ)
    if size is not None and size > 1:
        return None
    split = plan_split(allowed_cpus())
    if split is None:
        return None
    try:
        pin_process(split.front_end)
    except AffinityError as exc:
        log.warning("%s; leaving the daemon's placement to the OS", exc)
        return None
    log.info(
        "front end on CPUs %s, engine process on CPUs %s (cpu_affinity = 'off' in the config file leaves both to the OS)",
        _cpu_list(split.front_end),
        _cpu_list(split.engine),
    )
    return split


def _cpu_list(cpus: tuple[int, ...]) -> str:
    """``0-13`` for a run of CPUs, ``0,2,5`` otherwise."""
    if len(cpus) > 2 and cpus[-1] - cpus[0] == len(cpus) - 1:
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))
