"""Joining the pieces: a front end on anyio's asyncio backend and one engine thread."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio

from scheduler.engine_process import EngineProcess
from scheduler.frontend import FrontEnd, FrontEndSettings
from workers.loop import EngineSettings, EngineThread, Signal, release_thread_streams

SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class DaemonSettings:
    """What to serve (the model, the engine) and how (the front end's socket, limits, tenants)."""

    front: FrontEndSettings
    model: str = "demo"
    context_length: int | None = None
    engine: EngineSettings = field(default_factory=EngineSettings)
    #: Run the engine in its own process (``scheduler.engine_process``), so the front end's work
    #: never competes with decode steps for one GIL; ``False`` keeps it on a thread of the daemon.
    engine_process: bool = True


def check_models(settings: DaemonSettings) -> None:
    """Refuse a model or drafter directory that cannot load (``ModelError``), before the socket is
    bound: the engine thread loads them later, and a failure there would come after the daemon
    took its address, as a traceback in the log."""
    from workers.models import ModelError, check_model

    check_model(settings.model)
    draft, mtp = settings.engine.draft, settings.engine.mtp
    if draft is not None and draft not in ("prompt-lookup", "demo"):
        check_model(draft, "--draft")
    if mtp is not None and mtp != "demo" and not (Path(mtp).expanduser() / "config.json").is_file():
        raise ModelError(f"--mtp {mtp!r} is not an MTP head directory (no config.json in it); pass one, or 'demo'")


def serve(settings: DaemonSettings) -> int:
    """Run the daemon in this (main) thread until SIGINT/SIGTERM; return the exit code.

    A configuration that must not start raises (``ModelError``, ``SettingError``, ``ConfigError``,
    ``TenantsError``) before anything is bound; the command line turns those into one line."""
    from workers.models import load
    from workers.startup import check_environment

    check_models(settings)
    check_environment()

    def make_engine(emit: Callable[[list[Signal]], None]) -> EngineThread | EngineProcess:
        if settings.engine_process:
            return EngineProcess(settings.model, settings.context_length, emit, settings.engine)
        return EngineThread(lambda: load(settings.model, settings.context_length), emit, settings.engine)

    # The front end hands the engine at most one batch's worth of sequences at a time.
    front_settings = replace(
        settings.front, capacity=settings.engine.max_batch, prefix_cache_bytes=settings.engine.prefix_cache_bytes
    )
    front = FrontEnd(front_settings, make_engine)
    # The engine thread and the event loop share the GIL. A short switch interval keeps the
    # loop's bookkeeping from holding up the next decode step by up to the default 5 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return anyio.run(front.run, backend="asyncio")
    finally:
        release_thread_streams()  # MLX asks every thread that used it, the main one too
