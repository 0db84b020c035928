"""The requests in flight and where each one is: being tokenized, waiting in the fair queue, or
running in one of the engine's slots.

``Flight`` holds what every part of the front end reads about them: the request table, the fair
queue, the tenants in force, the engine handle, the model it runs and whether the daemon is closing.
It moves a request between those places: ``queue`` puts an admitted one in its tenant's queue,
``pump`` hands waiting ones to the engine while it has free slots and the KV budget allows,
``release`` frees a slot when the engine finishes one, and ``finish_here`` ends one the engine does
not hold. A sequence whose connection stopped reading is *parked* after a while (``park``): it stays
paused in the engine with its KV (still reserved), but its slot goes to others; once its connection
reads again it waits for the next free slot ahead of the fair queue (``wake``). It never waits: the engine handle only takes commands, and the only messages it sends are
those ends.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio

from clients.protocol import ErrorCode, FinishReason
from scheduler.engine_process import EngineHandle
from scheduler.fairness import FairQueue
from scheduler.outputs import Outputs
from scheduler.requests import RequestTable, Tracked
from scheduler.settings import FrontEndSettings, request_kv_budget
from scheduler.tenants import Tenant, local_table
from workers.api import ModelInfo

#: How often the daemon looks for a tenant that only its token bucket holds back, and the slack
#: added to a refill's due time (a bucket must be above zero, not at it, to start a request).
REFILL_POLL_S = 0.05
REFILL_SLACK_S = 0.001

#: Sends one message to one connection (``Transport.send``).
Send = Callable[[bytes, dict[str, Any]], None]


class Flight:
    """Every request the daemon owes an end to, where it is, and the slots and KV it holds.

    ``engine`` is given once the front end has made the engine (before any request can reach it);
    ``info`` and ``tokenizer`` once the engine is ready; ``table`` is replaced by a tenant reload."""

    engine: EngineHandle

    def __init__(
        self, settings: FrontEndSettings, outputs: Outputs, send: Send, is_paused: Callable[[bytes], bool]
    ) -> None:
        self.settings = settings
        #: Keyed by (tenant, connection, request id): a request is reachable only from the connection
        #: that sent it, and only while that connection speaks with the same tenant's key.
        self.requests = RequestTable()
        self.fair: FairQueue[Tracked] = FairQueue()
        self.table = local_table()
        self.outputs = outputs
        self.info: ModelInfo | None = None
        #: The model's tokenizer once ready (for the event loop and worker threads, never MLX).
        self.tokenizer: Any = None
        #: ``loading``, ``ready`` or ``shutting_down``; ``closing`` once new requests are refused.
        self.status = "loading"
        self.closing = False
        #: Slots taken: sequences handed to the engine, not finished and not parked; and the KV bytes
        #: every sequence in the engine reserves (parked ones included).
        self.in_engine = 0
        self.kv_reserved = 0
        #: Parked sequences whose connection reads again, waiting for a slot, oldest first.
        self._waking: deque[Tracked] = deque()
        self._send = send
        self._is_paused = is_paused

    # ------------------------------------------------------------------ ends given here

    def finish_here(
        self,
        t: Tracked,
        reason: FinishReason,
        error: tuple[ErrorCode, str] | None,
        retry_after_s: float | None = None,
    ) -> None:
        """End a request the engine does not hold (waiting, refused, or after the engine stopped)."""
        self.requests.discard(t)
        self.requests.pop_seq(t.seq)
        self.fair.remove(t.tenant, t)
        end = self.outputs.ended_here(t, reason, error, retry_after_s)
        if end is not None:
            self._send(t.client, end)

    def end_all(self, code: ErrorCode, message: str) -> None:
        """Requests the engine never answered for (still tokenizing, or the engine is gone)."""
        for t in list(self.requests):
            self.finish_here(t, FinishReason.ERROR, (code, message))

    # ------------------------------------------------------------------ slots and the KV budget

    def kv_need(self, t: Tracked) -> int:
        """KV bytes ``t`` may come to hold: its whole prompt and every token it may generate."""
        assert self.info is not None and t.job is not None
        return (len(t.job.prompt) + t.job.max_tokens) * self.info.kv_bytes_per_token

    def fits(self, t: Tracked) -> bool:
        """Whether ``t`` fits in what the KV budget has left now (always, without a budget)."""
        budget = request_kv_budget(self.settings)
        return not budget or t.job is None or self.kv_reserved + self.kv_need(t) <= budget

    def queue(self, tenant: Tenant, t: Tracked) -> None:
        """Put an admitted request (its ``job`` built) in its tenant's queue, at the priority the
        tenant may use, and start whatever can start."""
        self.fair.push(tenant, t, min(t.req.priority, tenant.priority_ceiling))
        self.pump()

    def pump(self) -> None:
        """Give free slots to parked sequences whose connection reads again, then hand waiting
        requests to the engine, fairest tenant first."""
        while self._waking and self.in_engine < self.settings.capacity:
            t = self._waking.popleft()
            if t.parked and self.requests.by_seq(t.seq) is t:
                t.parked = False
                self.in_engine += 1
                self.engine.resume(t.seq)
        now = time.monotonic()
        while self.in_engine < self.settings.capacity and not self.closing:
            nxt = self.fair.pop(self.table.tenants, now, self.fits)
            if nxt is None:
                return
            name, t = nxt
            if not self.requests.holds(t) or t.job is None:
                continue
            self.fair.admitted(self.table.tenants[name], t.prompt_tokens)
            self.in_engine += 1
            self.kv_reserved += self.kv_need(t)
            self.requests.enter_engine(t)
            self.engine.submit(t.job)
            if self._is_paused(t.client):
                self.engine.pause(t.seq)

    def release(self, seq: int) -> Tracked | None:
        """The engine finished ``seq``: free its slot and KV, start what can start in its place and
        stop tracking it. Returns the request, or ``None`` if the engine held no such sequence."""
        t = self.requests.pop_seq(seq)
        if t is None:
            return None
        if t.parked:
            t.parked = False  # its slot was given back when it was parked
        else:
            self.in_engine -= 1
        self.kv_reserved -= self.kv_need(t)
        self.fair.finished(t.tenant)
        self.pump()
        self.requests.discard(t)
        return t

    def park(self, t: Tracked) -> None:
        """Give the slot of ``t`` (in the engine, paused there because its connection stopped
        reading) to others; its KV stays reserved, and it gets a slot back after ``wake``."""
        if not t.in_engine or t.parked or self.requests.by_seq(t.seq) is not t:
            return
        t.parked = True
        self.in_engine -= 1
        self.pump()

    def wake(self, t: Tracked) -> None:
        """The connection of parked ``t`` reads again: it resumes at the next free slot, before any
        waiting request."""
        if t.parked and not any(w is t for w in self._waking):
            self._waking.append(t)
        self.pump()

    @property
    def parked(self) -> int:
        """Sequences parked now (no slot, KV kept)."""
        return sum(1 for t in self.requests.in_engine() if t.parked)

    async def pump_on_refill(self) -> None:
        """Start waiting requests when a token bucket refills. Submits and finishes pump too, but a
        rate-limited tenant with nothing running has neither: without this it would wait forever.
        It pumps after every poll as well: a bucket that refilled above zero while no refill was
        due (its last request still ran when the loop looked; it finished with the bucket spent, and
        the bucket refilled during the poll's sleep) is no longer "held back by its bucket", and a
        CI run under load stalled that way with 8 of 12 requests waiting."""
        while True:
            delay = self.fair.next_refill(self.table.tenants, time.monotonic())
            await anyio.sleep(REFILL_POLL_S if delay is None else delay + REFILL_SLACK_S)
            self.pump()
