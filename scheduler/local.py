"""In-process connections to the front end (the HTTP front door in ``scheduler.http_api`` uses one
per request).

They enter the same request table, fair queue and limits as ZeroMQ connections: their events go into
a bounded memory stream instead of the socket (``Transport.open_local``), with the same outbox and
pausing when their reader falls behind, and closing one is a disconnect.
"""

from __future__ import annotations

import os
from typing import Any

from anyio.streams.memory import MemoryObjectReceiveStream

from clients.protocol import Submit
from scheduler.intake import Intake


class LocalConnection:
    """An in-process connection to the front end.

    Its requests go through exactly the ZeroMQ path (tenant limits, fair queue, admission, stop
    strings, metrics), and ``events`` yields the same maps a ZeroMQ client would receive, one per
    message. Its routing id starts with a zero byte and is 17 bytes long: ZeroMQ's own ids for peers
    are 5 bytes and a peer's chosen id may not start with zero, so no socket peer can ever share it.
    ``close`` is a disconnect: what is still in flight ends ``disconnected`` and frees its slot."""

    def __init__(
        self,
        intake: Intake,
        tenant: str,
        events: MemoryObjectReceiveStream[dict[str, Any]],
        client_id: bytes | None = None,
    ) -> None:
        self.id = client_id if client_id is not None else self.new_id()
        self.tenant = tenant
        self.events = events
        self._intake = intake

    @staticmethod
    def new_id() -> bytes:
        return b"\x00" + os.urandom(16)

    def submit(self, req: Submit) -> None:
        self._intake.submit_local(self.id, self.tenant, req)

    def cancel(self, rid: str) -> None:
        self._intake.cancel_local(self.id, self.tenant, rid)

    def close(self) -> None:
        self._intake.close_local(self.id, "its in-process client closed it")
        self.events.close()
