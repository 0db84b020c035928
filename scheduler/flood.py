"""The flood cut: how much a connection may send while the daemon never catches up with it, and
shutting down the socket of one that goes past that.

Input never stops (no receive high-water mark: libzmq aborts when a PING meets a stopped input), so
nothing else bounds what a connection that sends faster than the daemon reads leaves queued. The
transport counts what it reads from each connection while each read finds the next message already
waiting, and cuts a connection whose count passes ``FLOOD_MESSAGES``.
"""

from __future__ import annotations

import os
import socket

#: The ROUTER's receive high-water mark: none. libzmq 4.3.5 answers a peer's PING at once, and
#: asserts (``!_io_error``, zeromq/libzmq#3937) when it does so on a connection whose input a full
#: receive queue had stopped and which then hung up; an unbounded queue never stops a connection's
#: input. What a connection may queue is bounded by the reader instead (``FLOOD_MESSAGES``).
RCVHWM = 0
#: Messages the reader may take from one connection while it never catches up with the socket
#: (each read found a message already waiting). A connection that goes on sending faster than the
#: daemon reads is cut (its socket shut down): without a receive high-water mark nothing else would
#: stop what it queues from growing. Far above what a client keeps in flight (the client library's
#: ``generate_many`` sends at most ``DEFAULT_CONCURRENCY`` jobs at once).
FLOOD_MESSAGES = 4096


def shut_down(fd: int) -> bool:
    """Shut down the connection on descriptor ``fd`` (libzmq's own) through a copy of it: libzmq
    reads the end of the stream and closes the connection itself. ``False`` if that failed."""
    try:
        copy = os.dup(fd)  # the same connection; closing the copy leaves libzmq's descriptor open
    except OSError:
        return False
    try:
        dup = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return False
    with dup:
        try:
            dup.shutdown(socket.SHUT_RDWR)  # libzmq reads the end of the stream and closes it
        except OSError:
            return False
    return True
