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

This module is the parent's side (the handle the front end drives); the child's side is
``engine_child``, the only one of the two that imports the engine. Every message either way is
converted once, by ``workers.api``'s ``to_wire``/``from_wire``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import msgpack
import zmq

from scheduler.engine_lifetime import make_private_folder
from scheduler.engine_spawn import Spawned, spawn
from scheduler.engine_watchdog import ENGINE_TIMEOUT_S, Watchdog
from scheduler.event_pipe import Receiver, open_pipe, unread
from workers.api import (
    Cancel,
    Dead,
    EnginePart,
    EngineSettings,
    Finished,
    FinishReason,
    Job,
    Pause,
    Ready,
    Resume,
    Shutdown,
    Signal,
    Stopped,
    SubmitJob,
    Timings,
    from_wire,
    to_wire,
)

log = logging.getLogger("mlx_batchd")

#: Seconds the parent waits for a child whose event pipe ended to be reaped, before saying so.
REAP_S = 10.0


# ----------------------------------------------------------------------------- frames


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


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
        spawned: Spawned | None = None,
    ) -> None:
        """``cpus``: where the engine process runs (``scheduler.affinity``); ``None`` leaves it where
        the OS puts it. ``engine_timeout_s``: pending work without
        a word from the engine for this long kills it and reports it ``Dead`` (``engine_watchdog``;
        0 = never). ``spawned``: the process, started early (``engine_spawn``); else ``start``
        starts it."""
        self._spawned = spawned
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
        #: The event pipe for the process ``start`` starts (a spawned one came with its own).
        self._pipe: tuple[int, int] | None = None
        if spawned is None:
            self._pipe = open_pipe()
            self._events = self._pipe[0]
        else:
            self._events = spawned.events
        #: The child's ``ready`` has passed (set under the lock, by the receiver).
        self._ready = False
        #: A shutdown came before ``ready`` and terminated the child: its end is a stop, not a death.
        self._stopped_early = False
        self._receiver = Receiver(self._events, self._on_message, self._on_end, "mlx-batchd-engine-events")
        self._watchdog = Watchdog(engine_timeout_s, self._hung, self._words_waiting)

    def start(self) -> None:
        self._tokenizer_loader.start()
        spawned = self._spawned or spawn(self._pipe)
        spec = {
            "model": self._model,
            "context_length": self._context_length,
            "settings": to_wire(self._settings),
            "folder": str(self._folder),
            "events_fd": spawned.events_fd,
            "cpus": None if self._cpus is None else list(self._cpus),
            "log_level": logging.getLogger().getEffectiveLevel(),
        }
        self._proc = spawned.proc
        try:
            spawned.send(pack(spec))
        except OSError as exc:  # it died before reading them (a broken install, say): its pipe's end says so
            log.error("the engine process took no settings: %s", exc)
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
        return from_wire("stats", self._snapshot)

    # Commands: never block (the child reads them at once; the queue is unbounded). The watchdog
    # hears of each before it is sent: where events are read on a thread, the answer could come first.
    def submit(self, job: Job) -> None:
        cmd = to_wire(SubmitJob(job))
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
        self._send(to_wire(Cancel(seq, reason, code, message)))

    def pause(self, seq: int) -> None:
        self._watchdog.paused(seq)
        self._send(to_wire(Pause(seq)))

    def resume(self, seq: int) -> None:
        self._watchdog.resumed(seq)
        self._send(to_wire(Resume(seq)))

    def shutdown(
        self, reason: str = "error", code: str = "shutdown", message: str = "the daemon is shutting down"
    ) -> None:
        with self._lock:
            if not self._ready and self._proc is not None and self._proc.returncode is None:
                self._stopped_early = True
                self._proc.terminate()
                return
        self._watchdog.stopping()
        self._send(to_wire(Shutdown(reason, code, message)))

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
        # mlx-lm's tokenizer loader: importing any ``mlx_lm`` module runs its package's ``__init__``,
        # which imports MLX, so this thread loads MLX into the front end's process (it runs nothing
        # on it; nothing at import time does). The import also lowers ``RLIMIT_NOFILE`` to
        # (2048, 4096): the daemon's raised limit is put back.
        from scheduler.http_limits import descriptor_limit_raised

        with descriptor_limit_raised():
            from workers.models.loading import load_tokenizer

        try:
            self._tokenizer = load_tokenizer(self._model)
        except BaseException as exc:  # reported with ``ready``, where the tokenizer is needed
            self._tokenizer_error = exc

    def _with_tokenizer(self, signals: list[Signal]) -> list[Signal]:
        """``Ready`` crosses without its tokenizer: this process's own goes in (or its load's error
        is raised)."""
        if not any(isinstance(s, Ready) for s in signals):
            return signals
        if self._tokenizer_error is not None:
            raise self._tokenizer_error
        return [replace(s, tokenizer=self._tokenizer) if isinstance(s, Ready) else s for s in signals]

    def _on_message(self, msg: dict[str, Any]) -> bool:
        """One message's events to ``emit``; ``True`` for the final one."""
        if "snapshot" in msg:
            self._snapshot = msg["snapshot"]
        self._watchdog.heard(msg["events"])  # before the conversion, which consumes the maps
        try:
            signals = self._with_tokenizer(from_wire("signals", msg["events"]))
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
                self._send(to_wire(Shutdown("error", "shutdown", "the daemon is shutting down")))
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
