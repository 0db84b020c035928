"""The fair queue on its own: weighted service, priority within a tenant, concurrency caps, and the
token-rate budget that holds a tenant back until it refills."""

from __future__ import annotations

from scheduler.fairness import FairQueue
from scheduler.tenants import Tenant


def test_fair_queue_orders_by_weighted_service_priority_and_caps() -> None:
    a, b = Tenant("a", weight=1.0), Tenant("b", weight=2.0, max_concurrent=1)
    tenants = {"a": a, "b": b}
    q: FairQueue[str] = FairQueue()
    q.push(a, "a1")
    assert q.pop(tenants, 0.0) == ("a", "a1")
    q.admitted(a, 10)
    q.generated(a, 10)  # a's counter: 20
    q.push(b, "b-low", priority=0)
    q.push(b, "b-high", priority=5)
    assert q.state["b"].counter == 20  # a returning tenant is lifted to the busy minimum
    q.push(a, "a2")
    assert q.pop(tenants, 0.0) == ("b", "b-high")  # tie on counter: b's head arrived first; priority inside b
    q.admitted(b, 10)  # b: 20 + 10 / 2 = 25
    assert q.pop(tenants, 0.0) == ("a", "a2")  # b is at its concurrency cap anyway
    q.admitted(a, 1)
    assert q.pop(tenants, 0.0) is None  # only b-low waits, and b is capped
    q.finished("b")
    assert q.pop(tenants, 0.0) == ("b", "b-low")


def test_token_rate_budget_holds_a_tenant_back_until_it_refills() -> None:
    t = Tenant("t", token_rate=10.0, token_burst=20.0)
    q: FairQueue[str] = FairQueue()
    q.push(t, "r1")
    q.push(t, "r2")
    assert q.pop({"t": t}, 0.0) == ("t", "r1")
    q.admitted(t, 15)
    q.generated(t, 10)  # 25 tokens spent from a bucket of 20
    q.finished("t")
    assert q.pop({"t": t}, 0.1) is None  # 20 - 25 + 1 refilled: still in debt
    assert q.pop({"t": t}, 1.0) == ("t", "r2")  # 10 tokens/s: back in credit after 0.5 s
