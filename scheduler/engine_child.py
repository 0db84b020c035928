"""The engine process's side of ``engine_process``: load the model, apply the daemon's commands to an
``EngineThread``, write its events to the pipe (``engine_outbox``); and a follower rank's main.

Run as ``python -m scheduler.engine_child``; only the engine process (and a follower rank) imports
it, so the front end never loads the engine.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import zmq

from scheduler.affinity import AffinityError, pin_process
from scheduler.engine_lifetime import die_with_parent, sigterm_until_ready
from scheduler.engine_outbox import SNAPSHOT_POLL_S, Outbox
from scheduler.engine_process import unpack
from scheduler.event_pipe import PipeWriter
from scheduler.lean_imports import keep_out
from workers.api import Dead, EngineSettings, Ready, Signal, Stopped, from_wire, to_wire

log = logging.getLogger("mlx_batchd")

#: How often the child looks for its daemon being gone while no command arrives.
LIVENESS_POLL_MS = 200
#: Seconds an engine process whose daemon is gone waits for its engine to stop before it exits anyway.
ORPHAN_GRACE_S = 15.0
#: Seconds a follower rank given SIGTERM waits for rank 0's stop (beyond the daemon's drain) when
#: ``rank_timeout`` is off.
FOLLOWER_STOP_GRACE_S = 60.0


def child_main(argv: list[str] | None = None) -> int:
    """The engine process: load, serve commands, exit when the engine thread has stopped.

    ``argv``: the daemon's pid, and ``1`` when the child is to die with the thread that started it
    (``engine_lifetime.die_with_parent``). Started under ``mlx.launch`` (it inherits the daemon's
    ``MLX_*`` environment) its engine joins the group as rank 0 and leads the other ranks
    (``workers.engine.loop``); ``from_env`` is a no-op alone."""
    args = sys.argv[1:] if argv is None else argv
    parent = int(args[0]) if args else os.getppid()
    if args[1:2] == ["1"]:
        die_with_parent(parent)
    keep_out()  # before the engine's imports (mlx-lm's tokenizer imports transformers)
    from workers.dist import World
    from workers.engine.loop import EngineThread
    from workers.models.loading import load

    ready = threading.Event()
    sigterm_until_ready(ready)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when the engine stops
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    frame = sys.stdin.buffer.read()  # the settings: this process may have been started before they were known
    if not frame:
        print("mlx-batchd engine: the daemon sent no settings; exiting", file=sys.stderr, flush=True)
        return 1
    spec = unpack(frame)
    logging.getLogger().setLevel(spec.get("log_level", logging.INFO))  # the daemon's --log-level
    if spec.get("cpus"):
        try:  # before the engine thread starts: every thread it and MLX start inherits the mask
            pin_process(spec["cpus"])
        except AffinityError as exc:
            log.warning("%s; the engine process stays where the OS puts it", exc)
    folder = Path(spec["folder"])
    settings = from_wire("settings", spec["settings"])
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(f"ipc://{folder / 'commands'}")
    os.set_inheritable(spec["events_fd"], False)  # no process this one starts may hold the pipe open
    events = PipeWriter(spec["events_fd"])
    holder: list[EngineThread] = []
    outbox = Outbox(events, lambda: holder[0], to_wire)

    def emit(signals: list[Signal]) -> None:
        if not ready.is_set() and any(isinstance(s, Ready) for s in signals):
            ready.set()
        outbox.events(signals)

    engine = EngineThread(
        lambda: load(spec["model"], spec["context_length"], holder[0].world, widths=settings.may_pin),
        emit,
        settings,
        World.from_env,
    )
    holder.append(engine)
    engine.start()
    orphaned_at: float | None = None
    last_snapshot = time.monotonic()
    while engine.is_alive():
        if commands.poll(LIVENESS_POLL_MS):
            engine.command(from_wire("command", unpack(commands.recv())))
        elif os.getppid() != parent and orphaned_at is None:
            log.warning("the daemon is gone; stopping the engine")
            engine.shutdown(code="daemon_gone", message="the daemon is gone")
            orphaned_at = time.monotonic()
        elif orphaned_at is not None and time.monotonic() - orphaned_at > ORPHAN_GRACE_S:
            # The engine did not stop (stuck joining a group, or in a collective whose peer hangs):
            # nobody is left to serve, and no process may outlive the daemon.
            log.error("the engine did not stop %.0f s after the daemon went; exiting", ORPHAN_GRACE_S)
            os._exit(1)
        if time.monotonic() - last_snapshot >= SNAPSHOT_POLL_S:
            outbox.snapshot_if_changed()
            last_snapshot = time.monotonic()
    engine.join()  # the final signal is in the pipe now
    events.close()
    commands.close(linger=0)
    ctx.term()
    return 0


def follower_main(
    model: str, context_length: int | None, settings: EngineSettings, stop_grace_s: float = FOLLOWER_STOP_GRACE_S
) -> int:
    """A rank other than 0 of a daemon started under ``mlx.launch``: no socket, no front end, only
    the engine on its shard, replaying rank 0's plans (``workers.engine.loop``). Exits 0 when rank 0 stops
    it (its daemon shut down), 1 when a peer is lost or the ranks diverged, with one line saying so.

    SIGTERM does not end it at once: a launcher's group kill or a control-group stop signals every
    rank together, and rank 0's stop plan (after its drain) then ends every rank cleanly. A follower
    that gets no stop within ``stop_grace_s`` of its SIGTERM (it alone was signalled) exits 1."""
    keep_out()
    from workers.dist import World, launched_rank
    from workers.engine.loop import EngineThread
    from workers.models.loading import load

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when every rank stops
    termed: list[float] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: termed.append(time.monotonic()))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    final: list[Signal] = []
    holder: list[EngineThread] = []

    def emit(signals: list[Signal]) -> None:
        for sig in signals:
            if isinstance(sig, Ready):
                w = holder[0].world
                log.info("rank %d of %d ready: following rank 0 over %s", w.rank, w.size, w.backend)
            elif isinstance(sig, (Stopped, Dead)):
                final.append(sig)

    engine = EngineThread(
        lambda: load(model, context_length, holder[0].world, widths=settings.may_pin), emit, settings, World.from_env
    )
    holder.append(engine)
    engine.start()
    rank = f"rank {launched_rank(os.environ)}"
    told = False
    while engine.is_alive():
        engine.join(0.5)  # a signal's handler runs meanwhile
        if not termed or not engine.is_alive():
            continue
        if not told:
            log.info("%s: SIGTERM; following rank 0 until it stops every rank (at most %g s)", rank, stop_grace_s)
            told = True
        if time.monotonic() - termed[0] > stop_grace_s:
            print(
                f"mlx-batchd serve: {rank}: SIGTERM, and rank 0 did not stop the ranks within {stop_grace_s:g} s; "
                "exiting (stop rank 0, the daemon, to stop every rank)",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
    end = final[-1] if final else Dead("the engine thread ended without a word")
    if isinstance(end, Dead):
        said = end.error.rstrip()
        print(f"mlx-batchd serve: {said if said.startswith(rank) else f'{rank}: {said}'}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
