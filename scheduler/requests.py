"""The front end's request table: every request the daemon owes a terminal event to.

A request is found by ``(tenant, connection, request id)`` (what a cancel names) and, once in the
engine, by its sequence number (what engine events name). The table keeps the counts that admission
limits read (requests per connection, requests waiting per tenant and in all) up to date as requests
enter, move into the engine and leave, so checking a new submit against them costs no pass over the
table.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from typing import Any

from clients.protocol import Submit
from scheduler.stopping import StopStrings
from workers.api import Job

Key = tuple[str, bytes, str]


@dataclass
class Tracked:
    """One request the daemon owes a terminal event to."""

    client: bytes
    tenant: str
    rid: str
    seq: int
    received_at: float
    req: Submit
    job: Job | None = None
    last_token_at: float | None = None
    #: Its connection is gone: nothing more is sent for it (a new connection may reuse the id).
    detached: bool = False
    #: Its end is on its way (the engine was told to end it): no more tokens are sent.
    muted: bool = False

    @property
    def key(self) -> Key:
        return (self.tenant, self.client, self.rid)

    detok: Any = None
    stops: StopStrings | None = None
    #: A request with ``tools`` (``tool_choice`` not ``none``): reads the calls out of its text
    #: (``scheduler.chat_reply.Answer``).
    calls: Any = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_engine: bool = False
    #: In the engine, paused, and its decode slot given to others until its connection reads again.
    parked: bool = False
    cancel_requested: bool = False
    stopped: bool = False


class RequestTable:
    """Requests by key and by sequence, with the per-connection and per-tenant counts kept current.

    A request is *tracked* from ``add`` until ``discard``; it is *waiting* while tracked and not yet
    handed to the engine (``enter_engine``). The sequence index outlives the key: a request whose
    connection is gone leaves the key index at once but stays findable by sequence until the
    engine's ``Finished`` for it (``pop_seq``)."""

    def __init__(self) -> None:
        self._by_key: dict[Key, Tracked] = {}
        self._by_seq: dict[int, Tracked] = {}
        self._of_client: dict[bytes, dict[Key, Tracked]] = {}
        self._waiting_of: dict[str, int] = {}
        self._waiting = 0
        self._seqs = count()

    def next_seq(self) -> int:
        """A sequence number no other request of this daemon has had."""
        return next(self._seqs)

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: Key) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[Tracked]:
        return iter(self._by_key.values())

    def get(self, key: Key) -> Tracked | None:
        return self._by_key.get(key)

    def holds(self, t: Tracked) -> bool:
        """Whether ``t`` itself (not a later request under the same key) is tracked."""
        return self._by_key.get(t.key) is t

    def add(self, t: Tracked) -> None:
        """Track ``t``; its key must be free (the caller refuses a duplicate first)."""
        assert t.key not in self._by_key, t.key
        self._by_key[t.key] = t
        self._of_client.setdefault(t.client, {})[t.key] = t
        if not t.in_engine:
            self._waiting += 1
            self._waiting_of[t.tenant] = self._waiting_of.get(t.tenant, 0) + 1

    def discard(self, t: Tracked) -> None:
        """Stop tracking ``t`` by key, if it is still tracked (a no-op otherwise)."""
        if not self.holds(t):
            return
        del self._by_key[t.key]
        mine = self._of_client[t.client]
        del mine[t.key]
        if not mine:
            del self._of_client[t.client]
        if not t.in_engine:
            self._unwait(t.tenant)

    def enter_engine(self, t: Tracked) -> None:
        """``t`` (tracked) goes to the engine: it stops waiting and engine events may name it."""
        assert self.holds(t) and not t.in_engine
        t.in_engine = True
        self._unwait(t.tenant)
        self._by_seq[t.seq] = t

    def _unwait(self, tenant: str) -> None:
        self._waiting -= 1
        left = self._waiting_of[tenant] - 1
        if left:
            self._waiting_of[tenant] = left
        else:
            del self._waiting_of[tenant]

    def by_seq(self, seq: int) -> Tracked | None:
        return self._by_seq.get(seq)

    def pop_seq(self, seq: int) -> Tracked | None:
        return self._by_seq.pop(seq, None)

    def in_engine(self) -> Iterator[Tracked]:
        """Requests the engine holds (including ones whose connection is gone)."""
        return iter(self._by_seq.values())

    def of_client(self, client: bytes) -> list[Tracked]:
        """The tracked requests of one connection (a copy: the caller may end them)."""
        return list(self._of_client.get(client, {}).values())

    def client_count(self, client: bytes) -> int:
        """Requests tracked for ``client``, waiting or in the engine."""
        return len(self._of_client.get(client, ()))

    def has_rid(self, client: bytes, rid: str) -> bool:
        """Whether ``client`` has a request ``rid`` in flight under any tenant."""
        return any(key[2] == rid for key in self._of_client.get(client, ()))

    def waiting_tenants(self) -> list[str]:
        """Tenants with requests waiting (not yet in the engine)."""
        return list(self._waiting_of)

    def waiting(self, tenant: str | None = None) -> int:
        """Requests not yet in the engine: of ``tenant``, or of all tenants."""
        return self._waiting if tenant is None else self._waiting_of.get(tenant, 0)
