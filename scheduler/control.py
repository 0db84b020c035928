"""Commands about requests already in flight, and the questions asked about them.

``Control`` acts on what ``Flight`` holds without starting anything new: a ``cancel`` ends a request
wherever it is; a connection whose reader fell behind has its sequences paused and resumed, parked
(their slots given to others) once it has read nothing for ``park_after_s`` and ended once it has read
nothing for ``park_timeout_s``; a connection that is gone has its requests ended; a tenant reload (SIGHUP) ends the requests of the
tenants it removes; and it builds the ``health`` and ``stats`` replies (``scheduler.stats``).
Refusing a message is the caller's part: what cannot be done raises ``ProtocolError``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio

from clients.protocol import ErrorCode, FinishReason, ProtocolError, Stats
from scheduler.flight import Flight
from scheduler.settings import FrontEndSettings
from scheduler.stats import Counters, build_stats, health_message, stats_message, visible_tenant
from scheduler.stats_types import StatsReply
from scheduler.tenants import Tenant, TenantsError, load_tenants
from scheduler.transport import Transport

log = logging.getLogger("mlx_batchd")

#: How often connections that stopped reading are looked at for parking and ending.
PARK_POLL_S = 0.25


class Control:
    """Cancel, pause and resume, disconnect and tenant reload on the requests in flight; the
    ``health`` and ``stats`` replies."""

    def __init__(self, settings: FrontEndSettings, flight: Flight, transport: Transport, counters: Counters) -> None:
        self.settings = settings
        self._flight = flight
        self._transport = transport
        self._counters = counters
        self._started = time.monotonic()
        #: Connections whose reader fell behind, and since when (reset when their requests are ended).
        self._stalled_since: dict[bytes, float] = {}

    # ------------------------------------------------------------------ requests in flight

    def cancel(self, tenant: str, client: bytes, rid: str) -> None:
        """End request ``rid`` of this tenant on this connection wherever it is: the engine ends one
        it holds, one waiting for a slot ends here, one still being tokenized ends when admission
        sees the flag. ``UNKNOWN_REQUEST_ID`` when there is none."""
        flight = self._flight
        t = flight.requests.get((tenant, client, rid))
        if t is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_REQUEST_ID,
                f"no request {rid!r} of yours is in flight on this connection (finished already, or never sent)",
                rid,
            )
        if t.in_engine:
            flight.engine.cancel(t.seq, "cancelled")
        elif t.job is not None:
            flight.finish_here(t, FinishReason.CANCELLED, None)  # waiting for a slot
        else:
            t.cancel_requested = True  # still tokenizing: ends when admission sees the flag

    def set_paused(self, client: bytes, paused: bool) -> None:
        """Pause or resume every sequence of ``client`` in the engine (its queued requests are
        paused as they enter the engine, in ``Flight.pump``). A parked sequence resumes when a slot
        is free for it (``Flight.wake``)."""
        flight = self._flight
        if paused:
            self._stalled_since.setdefault(client, time.monotonic())
        else:
            self._stalled_since.pop(client, None)
        mine = [t for t in flight.requests.in_engine() if t.client == client and not t.detached]
        for t in mine:
            if paused:
                flight.engine.pause(t.seq)
            elif t.parked:
                flight.wake(t)
            else:
                flight.engine.resume(t.seq)

    async def tend_stalled(self) -> None:
        """Park and end the sequences of connections that stopped reading (``park_stalled``)."""
        while True:
            await anyio.sleep(PARK_POLL_S)
            self.park_stalled(time.monotonic())

    def park_stalled(self, now: float) -> None:
        """A connection that has read nothing for ``park_after_s`` gives its decode slots to others
        (its sequences stay paused with their KV); one that has read nothing for ``park_timeout_s``
        has its requests ended with ``disconnected`` (the ends wait in its outbox)."""
        s, flight = self.settings, self._flight
        for client, since in list(self._stalled_since.items()):
            stalled = now - since
            if stalled < s.park_after_s:
                continue
            mine = [t for t in flight.requests.of_client(client) if not t.detached]
            if stalled < s.park_timeout_s:
                for t in mine:
                    flight.park(t)
                continue
            self._stalled_since[client] = now  # later requests get the same time again
            if not mine:
                continue
            log.warning("client %s read nothing for %.0f s: ending its %d requests", client.hex(), stalled, len(mine))
            ended = (
                ErrorCode.DISCONNECTED,
                f"the client read nothing for {stalled:.0f} s (park_timeout in the config file)",
            )
            for t in mine:
                if t.in_engine:
                    if not t.muted:
                        t.muted = True
                        flight.engine.cancel(t.seq, FinishReason.ERROR.value, ended[0].value, ended[1])
                else:
                    flight.finish_here(t, FinishReason.ERROR, ended)

    def drop_client(self, client: bytes, why: str) -> None:
        """A connection that is gone: its requests end ``disconnected`` (nobody is left to tell, so
        nothing is sent for them), and nothing at all is sent to its id until a new connection
        with that id sends something itself."""
        flight = self._flight
        self._transport.forget(client)
        self._stalled_since.pop(client, None)
        mine = flight.requests.of_client(client)
        if not mine:
            return
        self._counters.clients_dropped += 1
        log.warning("client %s is gone (%s): ending its %d requests", client.hex(), why, len(mine))
        lost = (ErrorCode.DISCONNECTED, f"the client's connection was lost ({why})")
        for t in mine:
            t.detached = True
            if t.in_engine:
                flight.requests.discard(t)
                flight.engine.cancel(t.seq, FinishReason.ERROR.value, lost[0].value, lost[1])
            else:
                flight.finish_here(t, FinishReason.ERROR, lost)

    def reload_tenants(self) -> None:
        """SIGHUP: re-read the tenants file. New keys and limits apply to new requests; a tenant that
        is gone loses its requests at once (waiting and running ones end ``unauthorized``, one end
        each) and its key is refused from now on. A file that does not load leaves the old table."""
        if self.settings.tenants is None:
            return
        try:
            table = load_tenants(self.settings.tenants)
        except TenantsError as exc:
            log.error("tenants file not reloaded, keeping the old one: %s", exc)
            return
        flight = self._flight
        flight.table = table
        log.info("tenants reloaded: %s", ", ".join(sorted(table.tenants)))
        removed = (ErrorCode.UNAUTHORIZED, "the tenant was removed")
        for name in list(flight.fair.state):
            if name not in table.tenants:
                for t in flight.fair.drop_tenant_queue(name):
                    flight.finish_here(t, FinishReason.ERROR, removed)
        for t in list(flight.requests):
            if t.tenant not in table.tenants and t.in_engine and not t.muted:
                t.muted = True
                flight.engine.cancel(t.seq, FinishReason.ERROR.value, removed[0].value, removed[1])
        flight.pump()

    # ------------------------------------------------------------------ replies

    def health(self, rid: str) -> dict[str, Any]:
        s = self.settings
        return health_message(rid, self._flight.status, self._flight.info, s.limits, s.max_frame_bytes)

    def stats_reply(self, tenant: Tenant, req: Stats) -> dict[str, Any]:
        """What the asker may see (``scheduler.stats``)."""
        return stats_message(req.id, self.reply(visible_tenant(self._flight.table, tenant)))

    def stats(self, only: str | None = None) -> dict[str, Any]:
        """``reply`` as the plain map ``FrontEnd.stats`` declares (the metrics read its published
        copy back with ``scheduler.stats_types.read_stats``)."""
        return dict(self.reply(only))

    def reply(self, only: str | None = None) -> StatsReply:
        """Counters for the ``stats`` reply and the metrics. ``only`` limits the per-tenant tables
        (``tenants``, ``outcomes``) to that tenant: what a tenant that is not an admin may see."""
        flight = self._flight
        return build_stats(
            only=only,
            uptime_s=time.monotonic() - self._started,
            tenants=flight.table.tenants,
            fair=flight.fair,
            counters=self._counters,
            completed=flight.outputs.completed,
            outcomes=flight.outputs.outcomes,
            requests_in_flight=len(flight.requests),
            kv_reserved_bytes=flight.kv_reserved,
            kv_budget_bytes=self.settings.kv_budget_bytes,
            clients_paused=self._transport.paused_count,
            sequences_parked=flight.parked,
            unsent_messages=self._transport.unsent,
            engine=flight.engine.snapshot(),
        )
