"""Bounds on the daemon's HTTP listeners (``--http`` and ``--metrics``), and its descriptor limit.

Every connection costs a file descriptor, and libzmq aborts the whole process when it cannot get
one for a new ZeroMQ connection. So the HTTP listeners hold at most a fixed number of connections,
kept below the descriptor limit with room left for ZeroMQ, the engine's pipes and files; a
connection past the cap is answered 503 at once and closed, before any task is made for it. A
connection must finish its request head within ``HEAD_TIMEOUT_S`` (from its start, or from the end
of the previous answer on a kept-alive connection), and its body within the body timeout: one that
sends nothing, half a head, or a body that stalls is closed, however slowly it trickles bytes.

mlx-lm's import sets ``RLIMIT_NOFILE`` to (2048, 4096); ``descriptor_limit_raised`` puts the soft
limit back up to the hard limit the daemon was started with (or the highest the OS lets this
process have) once that import is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import resource
except ImportError:  # no ``resource`` module (Windows): the limit is left as it is
    resource = None  # type: ignore[assignment]

log = logging.getLogger("mlx_batchd")

#: Seconds a connection has to send a complete request head (and the idle time allowed between
#: two requests on one kept-alive connection).
HEAD_TIMEOUT_S = 5.0
#: Seconds past the body timeout after which a connection still sending its body is closed (the
#: route reading it answers 408 at the body timeout itself; this closes it also where none reads).
BODY_GRACE_S = 1.0
#: Connections the metrics listener holds at once (scrapers are few).
METRICS_MAX_CONNECTIONS = 16
#: ``http_max_connections`` when not given.
DEFAULT_HTTP_MAX_CONNECTIONS = 1024
#: Descriptors kept out of the HTTP listeners' reach: a quarter of the limit, within these bounds.
RESERVE_MIN, RESERVE_MAX = 64, 512
#: Seconds between two warnings that connections are being refused.
WARN_EVERY_S = 10.0


@dataclass(frozen=True)
class ListenerLimits:
    """What one listener allows: connections at once, and seconds for a request body."""

    max_connections: int
    body_timeout_s: float
    name: str = "HTTP"


def _refusal(limits: ListenerLimits) -> bytes:
    """The whole 503 answer for a connection past the cap (sent before its request is read)."""
    body = json.dumps(
        {
            "error": {
                "message": f"too many {limits.name} connections (at most {limits.max_connections}); try again later",
                "type": "service_unavailable_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and head and body deadlines (``limits``)."""

    limits: ClassVar[ListenerLimits]
    _last_warned: ClassVar[float] = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if full:
            self._refuse()
            return
        self._retime()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        super().data_received(data)
        self._retime()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._retime()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def _refuse(self) -> None:
        self.transport.write(_refusal(self.limits))
        self.transport.close()
        now = time.monotonic()
        cls = type(self)
        if now - cls._last_warned >= WARN_EVERY_S:
            cls._last_warned = now
            log.warning(
                "%s connections refused with 503: %d are open, the most allowed",
                self.limits.name,
                self.limits.max_connections,
            )

    def _deadline_phase(self) -> str | None:
        """``head`` while the client owes a request head, ``body`` while it owes the body, else
        ``None`` (the daemon owes the answer: no deadline on the client)."""
        if self.transport.is_closing():
            return None
        state = self.conn.their_state
        if state is h11.IDLE:
            return "head"
        if state is h11.SEND_BODY:
            return "body"
        return None

    def _retime(self) -> None:
        """Arm the deadline of the phase just entered; a phase keeps the deadline it started with,
        so bytes trickled in do not extend it."""
        phase = self._deadline_phase()
        if phase == self._phase:
            return
        self._phase = phase
        self._cancel_timer()
        if phase is not None:
            seconds = HEAD_TIMEOUT_S if phase == "head" else self.limits.body_timeout_s + BODY_GRACE_S
            self._timer = self.loop.call_later(seconds, self._expire)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        """The client missed its deadline: close (abort, if answer bytes it never read are still
        queued: a close would wait for them forever)."""
        self._timer = None
        if self.transport.get_write_buffer_size() > 0:
            self.transport.abort()
        elif not self.transport.is_closing():
            self.transport.close()


def protocol_for(limits: ListenerLimits) -> type[BoundedH11]:
    """The protocol class uvicorn makes for each connection of one listener."""
    return type("BoundedH11", (BoundedH11,), {"limits": limits})


def open_descriptors() -> int:
    """Descriptors this process has open now (a guess of 64 where it cannot be read)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(folder))
    return 64


def descriptor_limit() -> int | None:
    """The soft ``RLIMIT_NOFILE``, or ``None`` where there is none to read."""
    if resource is None:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def connection_cap(wanted: int, others: int = 0) -> int:
    """``wanted`` HTTP connections, lowered (with a warning) to what the descriptor limit leaves
    after the descriptors open now, ``others`` kept for another listener, and a reserve for ZeroMQ
    connections, the engine's pipes and files."""
    limit = descriptor_limit()
    if limit is None:
        return wanted
    reserve = max(RESERVE_MIN, min(RESERVE_MAX, limit // 4))
    room = max(1, limit - open_descriptors() - others - reserve)
    if room < wanted:
        log.warning(
            "http_max_connections %d lowered to %d: the descriptor limit (RLIMIT_NOFILE) is %d", wanted, room, limit
        )
        return room
    return wanted


def _raise_soft_limit(started_hard: int) -> None:
    """Soft = hard: the hard limit the process started with if the OS lets it be restored (mlx-lm
    lowered it to 4096; raising a hard limit needs privilege), else the hard limit now."""
    assert resource is not None
    hard_now = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for hard in dict.fromkeys((started_hard, hard_now)):
        for soft in dict.fromkeys((hard, 1 << 20, 65536, 10240)):
            if soft > hard and hard != resource.RLIM_INFINITY:
                continue
            if soft == resource.RLIM_INFINITY:
                continue  # macOS refuses an unlimited soft limit; the next tries a number
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                return
            except (ValueError, OSError):
                continue


@contextlib.contextmanager
def descriptor_limit_raised() -> Iterator[None]:
    """Around the daemon's imports (mlx-lm's lowers ``RLIMIT_NOFILE``): afterwards the soft limit is
    the hard limit the process started with, or the highest the OS allows it now."""
    if resource is None:
        yield
        return
    started_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    try:
        yield
    finally:
        _raise_soft_limit(started_hard)
