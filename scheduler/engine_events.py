"""Engine events, on the event loop: tokens and ends become wire messages for their connections.

The engine's events reach the loop through ``EngineEvents.emit`` (from any thread) into a queue that
one task empties (``consume``): steps that arrived while the loop was busy are handled as one, so a
connection's events from them cost one frame, not one per step. The queue is a deque and one future
to wake the task: an anyio memory stream cost a quarter of the front end's time with the GIL on this
development CPU (an event and a checkpoint per step, sampled with py-spy at B = 1).

``Tokens`` and ``Finished`` turn into messages (``scheduler.outputs``) for the connection that sent
the request; a ``Finished`` frees its slot in ``Flight``. ``Ready`` gives ``Flight`` the model and
tokenizer and tells the front end to start reading messages; ``Stopped`` and ``Dead`` end whatever is
left and set ``done``, after which nothing more is handled; after ``Dead`` the daemon's status is
``engine_dead`` (health not ready, HTTP 503) and nothing new is admitted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio

from clients.protocol import ErrorCode
from scheduler.flight import Flight
from scheduler.transport import Transport
from workers.api import Dead, Finished, ModelInfo, Ready, Signal, StepInfo, Stopped, Tokens

log = logging.getLogger("mlx_batchd")


def with_chat_template(info: ModelInfo, tokenizer: Any, template: str) -> ModelInfo:
    """Render every chat from now on with ``template`` (``--chat-template``) instead of the model's
    own: the Hugging Face tokenizer's template, which ``apply_chat_template`` renders, and no custom
    renderer of mlx-lm's in its way."""
    tokenizer.chat_template = template
    tokenizer.has_chat_template = True
    if getattr(tokenizer, "_chat_template", None) is not None:
        tokenizer._chat_template = None
    return replace(info, has_chat_template=True)


class EngineEvents:
    """Reads the engine's events and answers them. Made on the event loop (it holds an event)."""

    def __init__(self, flight: Flight, transport: Transport, on_ready: Callable[[Ready], None]) -> None:
        self._flight = flight
        self._transport = transport
        self._on_ready = on_ready
        #: Set once the engine stopped or died; ``exit_code`` is then the daemon's.
        self.done = anyio.Event()
        self.exit_code = 0
        # anyio's task APIs (which ``on_ready`` uses) need a task's context, never a bare
        # ``call_soon_threadsafe`` callback: the loop only queues events for the task that reads them.
        self._pending: deque[list[Signal]] = deque()
        self._wake: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def emit(self, signals: list[Signal]) -> None:
        """The engine's callback, from any thread: the engine process's receiver thread, or the
        loop's own where its events are read in the loop (then no hop at all)."""
        if threading.get_ident() == self._loop_thread:
            self._put(signals)
        else:
            self._loop.call_soon_threadsafe(self._put, signals)

    def _put(self, signals: list[Signal]) -> None:
        self._pending.append(signals)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def consume(self) -> None:
        """Handle the engine's events until cancelled."""
        pending = self._pending
        while True:
            if not pending:
                self._wake = self._loop.create_future()
                try:
                    await self._wake
                finally:
                    self._wake = None
                continue
            signals = pending.popleft()
            while pending:
                signals = signals + pending.popleft()
            # No checkpoint needed: the queue is filled only by callbacks the loop runs, so it is empty,
            # and the task waits, whenever the loop has other work between steps.
            self.dispatch(signals)

    def dispatch(self, signals: list[Signal]) -> None:
        """One batch of engine events; their messages for a connection leave as one step."""
        if self.done.is_set():
            return
        self._transport.begin_step()
        try:
            self._handle(signals)
        finally:
            self._transport.end_step()

    def _handle(self, signals: list[Signal]) -> None:
        flight = self._flight
        for sig in signals:
            if isinstance(sig, Tokens):
                self._on_tokens(sig)
            elif isinstance(sig, StepInfo):
                flight.outputs.step(sig)
            elif isinstance(sig, Finished):
                self._on_finished(sig)
            elif isinstance(sig, Ready):
                flight.info, flight.tokenizer = sig.info, sig.tokenizer
                if flight.settings.chat_template is not None:
                    flight.info = with_chat_template(sig.info, sig.tokenizer, flight.settings.chat_template)
                flight.status = "ready"
                self._on_ready(sig)
            elif isinstance(sig, Stopped):
                flight.end_all(ErrorCode.SHUTDOWN, "the daemon is shutting down")
                self.done.set()
            elif isinstance(sig, Dead):
                log.error("engine died:\n%s", sig.error)
                self.exit_code = 1
                flight.status = "engine_dead"
                flight.closing = True
                flight.end_all(ErrorCode.ENGINE_DEAD, "the engine failed; the daemon is exiting")
                self.done.set()

    def _on_tokens(self, ev: Tokens) -> None:
        flight = self._flight
        t = flight.requests.by_seq(ev.seq)
        if t is None or t.stopped or t.muted or t.detached:
            return
        msg, hit = flight.outputs.tokens(t, ev)
        if hit:
            flight.engine.cancel(t.seq, "stop")
        tenant = flight.table.tenants.get(t.tenant)
        if tenant is not None:
            flight.fair.generated(tenant, len(ev.tokens))
        self._transport.send(t.client, msg)

    def _on_finished(self, ev: Finished) -> None:
        t = self._flight.release(ev.seq)
        if t is None:
            return
        for msg in self._flight.outputs.finished(t, ev):
            self._transport.send(t.client, msg)
