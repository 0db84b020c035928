"""The ZeroMQ connection cap: the ZAP handler that refuses handshakes past it (``ZapGate``) and the
cap itself, fitted to the process's descriptor limit (``fitted_connection_cap``).

With a ZAP domain set on the daemon's socket, libzmq asks the handler about every handshake, NULL
ones included, so the cap holds whether CURVE is on or not; the transport counts the connections
open (from its socket monitor) and answers whether there is room.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

log = logging.getLogger("mlx_batchd")

#: ZeroMQ connections held at once when not configured (``zmq_max_connections``); lowered at start
#: to half the descriptors the HTTP listeners leave to ZeroMQ, the engine's pipes and files.
DEFAULT_MAX_CONNECTIONS = 256
#: The ZAP domain of the daemon's socket: with it set, libzmq asks the ZAP handler about every
#: handshake, NULL ones included, and the handler refuses those past the connection cap.
ZAP_DOMAIN = b"mlx-batchd"
#: The ZAP status a handshake refused for the connection cap gets (the client library reads it as
#: ``too_many_connections``; 400 stays a refused key). 300 is not used: libzmq sends the client no
#: answer for it and the handshake hangs.
ZAP_TOO_MANY = b"500"


class ZapGate(AsyncioAuthenticator):
    """The socket's ZAP handler, on the event loop: a handshake past the connection cap is refused
    (``ZAP_TOO_MANY``); the rest get pyzmq's checks (NULL: admitted; CURVE: the tenants' keys)."""

    def __init__(self, ctx: zmq.asyncio.Context, has_room: Callable[[], bool]) -> None:
        super().__init__(ctx)
        self._has_room = has_room

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) >= 6 and not self._has_room():
            self._send_zap_reply(msg[1], ZAP_TOO_MANY, b"too many connections")
            return
        await super().handle_zap_message(msg)


def fitted_connection_cap(wanted: int) -> int:
    """``wanted`` ZeroMQ connections, lowered (with a warning) to half the descriptors the HTTP
    listeners leave to ZeroMQ, the engine's pipes and files (``http_limits.connection_cap``)."""
    from scheduler.http_limits import RESERVE_MAX, RESERVE_MIN, descriptor_limit

    limit = descriptor_limit()
    if limit is None:
        return wanted
    room = max(1, max(RESERVE_MIN, min(RESERVE_MAX, limit // 4)) // 2)
    if room < wanted:
        log.warning(
            "zmq_max_connections %d lowered to %d: the descriptor limit (RLIMIT_NOFILE) is %d", wanted, room, limit
        )
        return room
    return wanted
