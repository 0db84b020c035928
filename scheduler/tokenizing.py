"""Tokenizing prompts off the event loop, in parallel, with a fair share per tenant.

Prompts wait in one queue per tenant; free workers take from the tenants in turn (round robin), and
no tenant holds more than ``workers - 1`` workers, so one is always free for another tenant: one
tenant's long prompts do not delay another tenant's prompt at all, however many it sends (a single
queue made the last arrival wait for every prompt before it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")

#: Threads that tokenize at once, all tenants together.
DEFAULT_WORKERS = 4


class FairTokenizer:
    """Runs blocking calls (tokenizing, chat templates) in worker threads, tenants taking turns."""

    def __init__(self, workers: int = DEFAULT_WORKERS) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self._limiter = anyio.CapacityLimiter(workers)
        #: Tenants with calls waiting for a worker, in turn order, and each one's waiting calls.
        self._turns: deque[str] = deque()
        self._waiting: dict[str, deque[anyio.Event]] = {}
        self._running: dict[str, int] = {}
        self._busy = 0

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    async def run(self, tenant: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread once it is ``tenant``'s turn."""
        granted = anyio.Event()
        self._waiting.setdefault(tenant, deque()).append(granted)
        if tenant not in self._turns:
            self._turns.append(tenant)
        self._dispatch()
        try:
            await granted.wait()
        except BaseException:
            if granted.is_set():
                self._done(tenant)
            else:
                self._withdraw(tenant, granted)
            raise
        try:
            return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=self._limiter)
        finally:
            self._done(tenant)

    def _cap(self) -> int:
        """Workers one tenant may hold: all but one, so another tenant always finds one free."""
        return max(1, self.workers - 1)

    def _dispatch(self) -> None:
        """Grant free workers to waiting calls, one tenant after another."""
        skipped = 0
        while self._busy < self.workers and self._turns and skipped < len(self._turns):
            tenant = self._turns[0]
            if self._running.get(tenant, 0) >= self._cap():
                self._turns.rotate(-1)
                skipped += 1
                continue
            queue = self._waiting[tenant]
            queue.popleft().set()
            self._busy += 1
            self._running[tenant] = self._running.get(tenant, 0) + 1
            self._turns.popleft()
            if queue:
                self._turns.append(tenant)
            else:
                del self._waiting[tenant]
            skipped = 0

    def _withdraw(self, tenant: str, granted: anyio.Event) -> None:
        """A call cancelled while it waited leaves the queue."""
        queue = self._waiting.get(tenant)
        if queue is None:
            return
        try:
            queue.remove(granted)
        except ValueError:
            return
        if not queue:
            del self._waiting[tenant]
            self._turns.remove(tenant)

    def _done(self, tenant: str) -> None:
        self._busy -= 1
        left = self._running[tenant] - 1
        if left:
            self._running[tenant] = left
        else:
            del self._running[tenant]
        self._dispatch()
