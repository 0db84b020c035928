"""The engine in its own process: the daemon's front end and its engine no longer share a GIL.

With the engine on a thread of the daemon, every decode step's events are handled by the event
loop on the same interpreter: the loop's per-step work and the GIL hand-overs it causes land
between decode steps, and on a GPU the daemon fell well short of the engine alone at large B. Here the engine runs in a child process (the vLLM v1
``EngineCore`` pattern) and the two talk over ZeroMQ with msgpack maps, one conversion each way:

- commands (``submit``, ``cancel``, ``pause``, ``resume``, ``shutdown``) go
  parent -> child on a PUSH socket; the child's main thread applies them to an ``EngineThread``;
- each batch of engine events goes child -> parent as one message over a pipe (``event_pipe``: a
  write costs microseconds where a ZeroMQ send woke an I/O thread on every step), converted and
  written by the engine thread between its steps (``engine_outbox``),
  with the engine's stats snapshot attached when it may have changed (so ``stats`` read after an
  ``end`` is current); the pipe's end of stream is how the parent learns the child is gone;
- the lifecycle is the thread's: ``ready`` (the parent loads the tokenizer itself: only the model's
  text is served by the front end), then events, then ``stopped`` or ``dead``. A child that exits
  without a final word (killed, out of memory) is reported ``dead`` by the parent; a child whose
  parent is gone shuts its engine down and exits. A shutdown before ``ready`` terminates the child
  instead of sending the command: it may not have connected its command socket yet, and it would
  load, warm up and check its kernels (minutes on a GPU) before reading one.

The command socket lives in a private (0700) temporary folder and the event pipe has no name, so
no other local user can reach the engine. Nothing is pickled: the child gets its settings as a
msgpack map on stdin.

No engine outlives its daemon, and no daemon waits on a hung engine (``engine_lifetime``,
``engine_watchdog``): on Linux the child dies with the thread that started it (the parent-death
signal), elsewhere a polling thread stops it; a daemon whose engine owes work and has said nothing for
``engine_timeout`` seconds kills it and reports it dead. The child ignores SIGTERM once it is ready
(a control-group stop signals every process at once): the daemon's shutdown command stops it cleanly.

At about 620 lines it is over the ~400 of the other modules because its one idea is one protocol
across a process boundary: its conversions, the parent's handle and the child's main are kept
together so both ends of every message read side by side (the child's writing of events,
``engine_outbox``, is its own module).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import msgpack
import zmq

from scheduler.affinity import AffinityError, pin_process
from scheduler.engine_lifetime import die_with_parent, make_private_folder, sigterm_until_ready
from scheduler.engine_outbox import SNAPSHOT_POLL_S, Outbox
from scheduler.engine_watchdog import ENGINE_TIMEOUT_S, Watchdog
from scheduler.event_pipe import PipeWriter, Receiver, open_pipe, unread
from workers.burst import BurstSettings
from workers.commands import job_from_plain as job_from_wire
from workers.commands import job_to_plain as job_to_wire
from workers.engine import Finished, Job, StepInfo, Timings, Tokens
from workers.jobs import StepKind, TokenMode
from workers.kernels import Level
from workers.loop import Dead, EngineSettings, EngineThread, Ready, Signal, Stopped
from workers.models import ModelInfo
from workers.params import FinishReason
from workers.probe import ProbePolicy
from workers.snapshot import EnginePart, read_engine

log = logging.getLogger("mlx_batchd")

#: How often the child looks for its daemon being gone while no command arrives.
LIVENESS_POLL_MS = 200
#: Seconds the parent waits for a child whose event pipe ended to be reaped, before saying so.
REAP_S = 10.0
#: Seconds an engine process whose daemon is gone waits for its engine to stop before it exits anyway.
ORPHAN_GRACE_S = 15.0
#: Seconds a follower rank given SIGTERM waits for rank 0's stop (beyond the daemon's drain) when
#: ``rank_timeout`` is off.
FOLLOWER_STOP_GRACE_S = 60.0


# ----------------------------------------------------------------------------- conversions


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def settings_to_wire(s: EngineSettings) -> dict[str, Any]:
    return asdict(s)


def settings_from_wire(d: dict[str, Any]) -> EngineSettings:
    policy = dict(d["probe_policy"])
    if policy.get("pinned_level") is not None:
        policy["pinned_level"] = Level(policy["pinned_level"])
    return EngineSettings(
        **{**d, "probe_policy": ProbePolicy(**policy), "bursts": BurstSettings(**d["bursts"])},
    )


def signal_to_wire(sig: Signal) -> dict[str, Any]:
    # The two kinds every step sends are spelled out: ``asdict`` (a recursive deep copy) cost ten
    # times as much, 0.36 ms per step at B = 64 on the development CPU.
    if isinstance(sig, Tokens):
        return {
            "t": "tokens",
            "seq": sig.seq,
            "tokens": sig.tokens,
            "logprobs": sig.logprobs,
            "mode": sig.mode,
            "top_logprobs": sig.top_logprobs,
        }
    if isinstance(sig, StepInfo):
        return {"t": "step", "kind": sig.kind, "seconds": sig.seconds, "batch_size": sig.batch_size}
    if isinstance(sig, Finished):  # every request sends one, on the engine thread: spelled out too
        return {
            "t": "finished",
            "seq": sig.seq,
            "reason": str(sig.reason),
            "prompt_tokens": sig.prompt_tokens,
            "completion_tokens": sig.completion_tokens,
            "timings": sig.timings.as_dict(),
            "error_code": sig.error_code,
            "error_message": sig.error_message,
        }
    if isinstance(sig, Ready):
        return {"t": "ready", "info": {**asdict(sig.info), "eos_token_ids": list(sig.info.eos_token_ids)}}
    if isinstance(sig, Stopped):
        return {"t": "stopped"}
    return {"t": "dead", "error": sig.error}


def signals_to_wire(signals: list[Signal]) -> list[dict[str, Any]]:
    """A step's events as wire maps, each run of two or more plain tokens (one batched token, no top
    logprobs: what a decode step gives each of its sequences) as one map of columns.

    A decode step at B = 128 is 128 such tokens: as columns, packing them on the engine thread and
    unpacking them in the front end cost a fraction of what 128 maps do, in a thirteenth of the bytes.
    Runs keep the events' order, so a sequence's end still follows its tokens."""
    wire: list[dict[str, Any]] = []
    run: list[Tokens] = []
    batched = TokenMode.BATCHED

    def close_run() -> None:
        if len(run) == 1:
            wire.append(signal_to_wire(run[0]))
        elif run:
            logprobs = [None if t.logprobs is None else t.logprobs[0] for t in run]
            wire.append(
                {
                    "t": "tokens_run",
                    "seq": [t.seq for t in run],
                    "token": [t.tokens[0] for t in run],
                    "logprob": None if logprobs.count(None) == len(logprobs) else logprobs,
                }
            )
        run.clear()

    for sig in signals:
        if type(sig) is Tokens and sig.mode is batched and sig.top_logprobs is None and len(sig.tokens) == 1:
            run.append(sig)
        else:
            close_run()
            wire.append(signal_to_wire(sig))
    close_run()
    return wire


def signals_from_wire(items: list[dict[str, Any]], tokenizer: Callable[[ModelInfo], Any]) -> list[Signal]:
    """``signals_to_wire``'s inverse: runs back to one ``Tokens`` a sequence, in order."""
    signals: list[Signal] = []
    for d in items:
        if d.get("t") != "tokens_run":
            signals.append(signal_from_wire(d, tokenizer))
            continue
        logprobs = d["logprob"] or [None] * len(d["seq"])
        signals += [
            Tokens(seq, [token], None if lp is None else [lp], TokenMode.BATCHED)
            for seq, token, lp in zip(d["seq"], d["token"], logprobs, strict=True)
        ]
    return signals


def signal_from_wire(d: dict[str, Any], tokenizer: Callable[[ModelInfo], Any]) -> Signal:
    kind = d.pop("t")
    if kind == "tokens":
        tops = d.pop("top_logprobs", None)  # msgpack gives its pairs back as lists
        mode = TokenMode(d.pop("mode"))
        return Tokens(
            **d, mode=mode, top_logprobs=None if tops is None else [[(t, lp) for t, lp in row] for row in tops]
        )
    if kind == "step":
        return StepInfo(**{**d, "kind": StepKind(d["kind"])})
    if kind == "finished":
        return Finished(**{**d, "reason": FinishReason(d["reason"]), "timings": Timings(**d["timings"])})
    if kind == "ready":
        info = ModelInfo(**{**d["info"], "eos_token_ids": tuple(d["info"]["eos_token_ids"])})
        return Ready(info, tokenizer(info))
    if kind == "stopped":
        return Stopped()
    return Dead(d["error"])


# ----------------------------------------------------------------------------- the parent's side


class EngineHandle(Protocol):
    """What the front end drives: ``EngineProcess`` (a test's fake in its place)."""

    def start(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def snapshot(self) -> EnginePart: ...
    def submit(self, job: Job) -> None: ...
    def cancel(
        self, seq: int, reason: str = "cancelled", code: str | None = None, message: str | None = None
    ) -> None: ...
    def pause(self, seq: int) -> None: ...
    def resume(self, seq: int) -> None: ...
    def shutdown(
        self, reason: str = "error", code: str = "shutdown", message: str = "the daemon is shutting down"
    ) -> None: ...


class EngineProcess:
    """``EngineThread``'s interface, with the engine in a child process.

    Commands are sent from the event loop's thread (a lock keeps any other caller safe); events
    are read by one receiver thread and handed to ``emit`` exactly as the engine thread would."""

    def __init__(
        self,
        model: str,
        context_length: int | None,
        emit: Callable[[list[Signal]], None],
        settings: EngineSettings | None = None,
        cpus: tuple[int, ...] | None = None,
        engine_timeout_s: float = ENGINE_TIMEOUT_S,
    ) -> None:
        """``cpus``: where the engine process runs (``scheduler.affinity``); ``None`` leaves it where
        the OS puts it. ``engine_timeout_s``: pending work without
        a word from the engine for this long kills it and reports it ``Dead`` (``engine_watchdog``;
        0 = never)."""
        self._model = model
        self._cpus = cpus
        self._context_length = context_length
        self._emit = emit
        self._settings = settings or EngineSettings()
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._tokenizer: Any = None
        self._tokenizer_error: BaseException | None = None
        self._tokenizer_loader = threading.Thread(target=self._load_tokenizer, name="mlx-batchd-tokenizer", daemon=True)
        self._folder = make_private_folder()  # 0700: only this user; stale ones removed first
        # Removed by ``join``, or at the latest when the interpreter exits (an exception, no join).
        self._remove_folder = weakref.finalize(self, shutil.rmtree, self._folder, True)
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._cmd.setsockopt(zmq.LINGER, 0)
        self._cmd.setsockopt(zmq.SNDHWM, 0)
        self._cmd.bind(f"ipc://{self._folder / 'commands'}")
        self._events, self._events_w = open_pipe()
        #: The child's ``ready`` has passed (set under the lock, by the receiver).
        self._ready = False
        #: A shutdown came before ``ready`` and terminated the child: its end is a stop, not a death.
        self._stopped_early = False
        self._receiver = Receiver(self._events, self._on_message, self._on_end, "mlx-batchd-engine-events")
        self._watchdog = Watchdog(engine_timeout_s, self._hung, self._words_waiting)

    def start(self) -> None:
        self._tokenizer_loader.start()
        spec = {
            "model": self._model,
            "context_length": self._context_length,
            "settings": settings_to_wire(self._settings),
            "folder": str(self._folder),
            "events_fd": self._events_w,
            "cpus": None if self._cpus is None else list(self._cpus),
            "log_level": logging.getLogger().getEffectiveLevel(),
        }
        # The parent-death signal fires when the thread that starts the child ends: asked for only
        # from the main thread (the daemon's), which lives as long as the daemon.
        die_with_me = threading.current_thread() is threading.main_thread()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler.engine_process", str(os.getpid()), "1" if die_with_me else "0"],
            stdin=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(self._events_w,),
        )
        os.close(self._events_w)  # the child holds the only write end: its end of stream is the child's
        assert self._proc.stdin is not None
        self._proc.stdin.write(pack(spec))
        self._proc.stdin.close()
        # Events are read once the tokenizer is loaded (``ready`` needs it): in the daemon's event
        # loop when this is called from it, else on a thread.
        self._receiver.start(after=self._tokenizer_loader)
        self._watchdog.start()

    def join(self, timeout: float | None = None) -> None:
        self._receiver.done.wait(timeout)
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("the engine process did not exit in %s s; killing it", timeout)
                self._proc.kill()
                try:
                    self._proc.wait(REAP_S)
                except subprocess.TimeoutExpired:  # stuck in the kernel: nothing more can be done here
                    log.error("the engine process (pid %d) did not die of SIGKILL", self._proc.pid)
            self._receiver.done.wait(REAP_S)  # a killed child's pipe ends: the receiver is done
        self._close()

    def is_alive(self) -> bool:
        return not self._receiver.done.is_set()

    def snapshot(self) -> EnginePart:
        """The child's last engine snapshot (msgpack gives it back as the map the child built)."""
        return read_engine(self._snapshot)

    # Commands: never block (the child reads them at once; the queue is unbounded). The watchdog
    # hears of each before it is sent: where events are read on a thread, the answer could come first.
    def submit(self, job: Job) -> None:
        cmd = {"c": "submit", "job": job_to_wire(job)}
        try:
            frame = pack(cmd)
        except (OverflowError, ValueError, TypeError) as exc:
            # Every field is range-checked where it enters; should a value msgpack cannot carry get
            # through anyway, it ends this one request (never sent, so never watched), not the daemon.
            log.error("job %d could not be sent to the engine: %s", job.seq, exc)
            why = f"a value of this request cannot be sent to the engine ({exc})"
            timings = Timings(None, None, None, 0.0)
            self._emit([Finished(job.seq, FinishReason.ERROR, len(job.prompt), 0, timings, "bad_field", why)])
            return
        self._watchdog.submitted(job.seq)
        self._send(cmd, frame)

    def cancel(self, seq: int, reason: str = "cancelled", code: str | None = None, message: str | None = None) -> None:
        self._watchdog.cancelled(seq)
        self._send({"c": "cancel", "seq": seq, "reason": reason, "code": code, "message": message})

    def pause(self, seq: int) -> None:
        self._watchdog.paused(seq)
        self._send({"c": "pause", "seq": seq})

    def resume(self, seq: int) -> None:
        self._watchdog.resumed(seq)
        self._send({"c": "resume", "seq": seq})

    def shutdown(
        self, reason: str = "error", code: str = "shutdown", message: str = "the daemon is shutting down"
    ) -> None:
        with self._lock:
            if not self._ready and self._proc is not None and self._proc.returncode is None:
                self._stopped_early = True
                self._proc.terminate()
                return
        self._watchdog.stopping()
        self._send({"c": "shutdown", "reason": reason, "code": code, "message": message})

    def _send(self, cmd: dict[str, Any], frame: bytes | None = None) -> None:
        """``frame``: ``cmd`` already packed."""
        with self._lock:
            if self._cmd.closed:
                return
            try:
                self._cmd.send(pack(cmd) if frame is None else frame, zmq.NOBLOCK)
            except zmq.Again:
                # No child is connected: it has exited (its event pipe's end reports that), so the
                # command has no one to reach.
                log.debug("engine process gone; dropped command %r", cmd["c"])

    def _load_tokenizer(self) -> None:
        from workers.models import load_tokenizer

        try:
            self._tokenizer = load_tokenizer(self._model)
        except BaseException as exc:  # reported with ``ready``, where the tokenizer is needed
            self._tokenizer_error = exc

    def _tokenizer_for(self, info: ModelInfo) -> Any:
        if self._tokenizer_error is not None:
            raise self._tokenizer_error
        return self._tokenizer

    def _on_message(self, msg: dict[str, Any]) -> bool:
        """One message's events to ``emit``; ``True`` for the final one."""
        if "snapshot" in msg:
            self._snapshot = msg["snapshot"]
        self._watchdog.heard(msg["events"])  # before the conversion, which consumes the maps
        try:
            signals = signals_from_wire(msg["events"], self._tokenizer_for)
        except Exception as exc:  # the tokenizer failed to load: the daemon cannot serve text
            self.shutdown()
            signals = [Dead(f"cannot load the tokenizer: {exc}")]
        if not self._ready and any(isinstance(s, Ready) for s in signals):  # once: this runs every step
            with self._lock:
                self._ready = True
                early = self._stopped_early
            if early:
                # The child got ready as the shutdown's SIGTERM came, and ignored it (a ready child
                # waits for the daemon's command): it gets the command now, and nobody is told it
                # was ready.
                signals = [s for s in signals if not isinstance(s, Ready)]
                self._send(
                    {"c": "shutdown", "reason": "error", "code": "shutdown", "message": "the daemon is shutting down"}
                )
            else:
                self._watchdog.ready()
        if signals:
            self._emit(signals)
        final = any(isinstance(s, (Stopped, Dead)) for s in signals)
        if final:
            self._watchdog.close()  # the engine's last word: it owes nothing more
        return final

    def _on_end(self) -> None:
        """The pipe ended without a final word: the child is gone (this may wait to reap it)."""
        assert self._proc is not None
        self._watchdog.close()
        try:
            code: int | str = self._proc.wait(REAP_S)
        except subprocess.TimeoutExpired:
            code = "unknown (it closed its event pipe but did not exit)"
        if self._stopped_early:
            log.info("the engine process was stopped before it was ready")
            self._emit([Stopped()])
            return
        if self._watchdog.fired:
            return  # the watchdog killed it, and has said why
        self._emit([Dead(f"the engine process exited with code {code} before it said why")])

    def _hung(self, why: str) -> None:
        """The watchdog's verdict (on its thread): every request ends ``engine_dead`` and the daemon
        exits 1, as for a dead engine; the engine process is killed (SIGKILL ends a stopped or
        GIL-bound process too), so none is left holding the model's memory."""
        log.error("%s; killing the engine process", why)
        self._emit([Dead(why)])
        assert self._proc is not None
        try:
            self._proc.kill()
        except OSError:
            pass

    def _words_waiting(self) -> bool:
        """Whether the event pipe holds bytes not read yet (or its end): the engine spoke."""
        return not self._receiver.done.is_set() and unread(self._events)

    def _close(self) -> None:
        self._watchdog.close()
        with self._lock:
            self._cmd.close(linger=0)
        if self._receiver.done.is_set():  # never close a descriptor another thread reads
            os.close(self._events)
        self._ctx.term()
        self._remove_folder()


# ----------------------------------------------------------------------------- the child's side


def _apply(engine: EngineThread, cmd: dict[str, Any]) -> None:
    kind = cmd["c"]
    if kind == "submit":
        engine.submit(job_from_wire(cmd["job"]))
    elif kind == "cancel":
        engine.cancel(cmd["seq"], cmd["reason"], cmd["code"], cmd["message"])
    elif kind == "pause":
        engine.pause(cmd["seq"])
    elif kind == "resume":
        engine.resume(cmd["seq"])
    elif kind == "shutdown":
        engine.shutdown(cmd["reason"], cmd["code"], cmd["message"])


def child_main(argv: list[str] | None = None) -> int:
    """The engine process: load, serve commands, exit when the engine thread has stopped.

    ``argv``: the daemon's pid, and ``1`` when the child is to die with the thread that started it
    (``engine_lifetime.die_with_parent``). Started under ``mlx.launch`` (it inherits the daemon's
    ``MLX_*`` environment) its engine joins the group as rank 0 and leads the other ranks
    (``workers.loop``); ``from_env`` is a no-op alone."""
    args = sys.argv[1:] if argv is None else argv
    parent = int(args[0]) if args else os.getppid()
    if args[1:2] == ["1"]:
        die_with_parent(parent)
    from workers.distributed import World
    from workers.models import load

    ready = threading.Event()
    sigterm_until_ready(ready)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when the engine stops
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = unpack(sys.stdin.buffer.read())
    logging.getLogger().setLevel(spec.get("log_level", logging.INFO))  # the daemon's --log-level
    if spec.get("cpus"):
        try:  # before the engine thread starts: every thread it and MLX start inherits the mask
            pin_process(spec["cpus"])
        except AffinityError as exc:
            log.warning("%s; the engine process stays where the OS puts it", exc)
    folder = Path(spec["folder"])
    settings = settings_from_wire(spec["settings"])
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(f"ipc://{folder / 'commands'}")
    os.set_inheritable(spec["events_fd"], False)  # no process this one starts may hold the pipe open
    events = PipeWriter(spec["events_fd"])
    holder: list[EngineThread] = []
    outbox = Outbox(events, lambda: holder[0], signals_to_wire)

    def emit(signals: list[Signal]) -> None:
        if not ready.is_set() and any(isinstance(s, Ready) for s in signals):
            ready.set()
        outbox.events(signals)

    engine = EngineThread(
        lambda: load(spec["model"], spec["context_length"], holder[0].world), emit, settings, World.from_env
    )
    holder.append(engine)
    engine.start()
    orphaned_at: float | None = None
    last_snapshot = time.monotonic()
    while engine.is_alive():
        if commands.poll(LIVENESS_POLL_MS):
            _apply(engine, unpack(commands.recv()))
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
    the engine on its shard, replaying rank 0's plans (``workers.loop``). Exits 0 when rank 0 stops
    it (its daemon shut down), 1 when a peer is lost or the ranks diverged, with one line saying so.

    SIGTERM does not end it at once: a launcher's group kill or a control-group stop signals every
    rank together, and rank 0's stop plan (after its drain) then ends every rank cleanly. A follower
    that gets no stop within ``stop_grace_s`` of its SIGTERM (it alone was signalled) exits 1."""
    from workers.distributed import World, launched_rank
    from workers.models import load

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

    engine = EngineThread(lambda: load(model, context_length, holder[0].world), emit, settings, World.from_env)
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
