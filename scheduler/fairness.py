"""Fair share of the decode slots between tenants: the Virtual Token Counter (VTC) scheduler.

From Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Each tenant has a
counter of the service it received, in tokens divided by its weight (prompt tokens when a request
is admitted, generated tokens as they are produced). When a slot frees, the next request comes
from the backlogged tenant with the lowest counter, so over any period in which two tenants are
both backlogged their weighted service differs by a bounded amount, however many requests each
sends. A tenant that returns after being idle has its counter lifted to the lowest counter among
the tenants being served, so idling does not bank credit.

Within a tenant, requests go by priority (higher first), then arrival. A tenant at its concurrency
cap, or out of its token-rate budget, waits; the others are served meanwhile.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from scheduler.tenants import Tenant

T = TypeVar("T")


@dataclass
class TenantState(Generic[T]):
    counter: float = 0.0
    queue: list[tuple[int, int, T]] = field(default_factory=list)  # (-priority, arrival, item)
    active: int = 0
    bucket: float | None = None
    refilled_at: float = 0.0
    served_prompt_tokens: int = 0
    served_generated_tokens: int = 0


class FairQueue(Generic[T]):
    """Requests waiting for a decode slot, and the per-tenant service counters."""

    def __init__(self, prompt_weight: float = 1.0, generated_weight: float = 1.0) -> None:
        self.prompt_weight = prompt_weight
        self.generated_weight = generated_weight
        self.state: dict[str, TenantState[T]] = {}
        self._arrivals = itertools.count()

    def _get(self, name: str) -> TenantState[T]:
        s = self.state.get(name)  # not ``setdefault``: it would build a state every call (every token)
        if s is None:
            s = self.state[name] = TenantState()
        return s

    def __len__(self) -> int:
        return sum(len(s.queue) for s in self.state.values())

    def queued(self, name: str) -> int:
        s = self.state.get(name)
        return 0 if s is None else len(s.queue)

    def push(self, tenant: Tenant, item: T, priority: int = 0) -> None:
        s = self._get(tenant.name)
        if not s.queue and s.active == 0:
            busy = [o.counter for n, o in self.state.items() if n != tenant.name and (o.queue or o.active)]
            if busy:
                s.counter = max(s.counter, min(busy))
        heapq.heappush(s.queue, (-priority, next(self._arrivals), item))

    def remove(self, name: str, item: T) -> bool:
        s = self.state.get(name)
        if s is None:
            return False
        for i, entry in enumerate(s.queue):
            if entry[2] is item:
                s.queue.pop(i)
                heapq.heapify(s.queue)
                return True
        return False

    def _refill(self, s: TenantState[T], tenant: Tenant, now: float) -> None:
        if tenant.token_rate <= 0:
            return
        capacity = tenant.token_burst or tenant.token_rate * 10.0
        if s.bucket is None:
            s.bucket, s.refilled_at = capacity, now
        s.bucket = min(capacity, s.bucket + tenant.token_rate * (now - s.refilled_at))
        s.refilled_at = now

    def eligible(self, tenant: Tenant, now: float) -> bool:
        s = self._get(tenant.name)
        self._refill(s, tenant, now)
        return s.active < tenant.max_concurrent and (s.bucket is None or s.bucket > 0)

    def next_refill(self, tenants: dict[str, Tenant], now: float) -> float | None:
        """Seconds until a waiting tenant that only its token bucket holds back may start again
        (``None`` when no such tenant waits): a refill is an event nothing else announces."""
        waits: list[float] = []
        for name, s in self.state.items():
            tenant = tenants.get(name)
            if not s.queue or tenant is None or tenant.token_rate <= 0 or s.active >= tenant.max_concurrent:
                continue
            self._refill(s, tenant, now)
            if s.bucket is not None and s.bucket <= 0:
                waits.append(-s.bucket / tenant.token_rate)
        return min(waits) if waits else None

    def pop(
        self, tenants: dict[str, Tenant], now: float, fits: Callable[[T], bool] | None = None
    ) -> tuple[str, T] | None:
        """The next request to admit, or ``None`` if nobody eligible is waiting. ``fits`` can hold
        back a tenant whose next request does not fit the resources left (e.g. the KV budget)."""
        best: tuple[float, int, str] | None = None
        for name, s in self.state.items():
            tenant = tenants.get(name)
            if not s.queue or tenant is None or not self.eligible(tenant, now):
                continue
            if fits is not None and not fits(s.queue[0][2]):
                continue
            key = (s.counter, s.queue[0][1], name)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        name = best[2]
        return name, heapq.heappop(self.state[name].queue)[2]

    def admitted(self, tenant: Tenant, prompt_tokens: int) -> None:
        s = self._get(tenant.name)
        s.active += 1
        s.served_prompt_tokens += prompt_tokens
        s.counter += self.prompt_weight * prompt_tokens / tenant.weight
        if s.bucket is not None:
            s.bucket -= prompt_tokens

    def generated(self, tenant: Tenant, tokens: int) -> None:
        s = self._get(tenant.name)
        s.served_generated_tokens += tokens
        s.counter += self.generated_weight * tokens / tenant.weight
        if s.bucket is not None:
            s.bucket -= tokens

    def finished(self, name: str) -> None:
        s = self._get(name)
        s.active = max(0, s.active - 1)

    def drop_tenant_queue(self, name: str) -> list[T]:
        """Everything a removed tenant had waiting (ended by the caller)."""
        s = self.state.get(name)
        if s is None:
            return []
        items = [entry[2] for entry in s.queue]
        s.queue.clear()
        return items
