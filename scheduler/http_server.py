"""Running the HTTP front door inside the daemon: a socket bound early, uvicorn on the daemon's loop.

The socket is bound before the engine starts, so a busy or bad address refuses the start like the
ZeroMQ address does (``BindError``). uvicorn then serves it as one task of the front end's task
group, on the same event loop, with its signal handlers off: the daemon owns SIGINT, SIGTERM and
SIGHUP, and stops the server itself (``stop``) once every request has had its last event.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio
import uvicorn

from scheduler.http_auth import split_host_port

if TYPE_CHECKING:
    from scheduler.frontend import FrontEnd

#: Seconds uvicorn gives open answers to finish once the daemon stops it.
GRACEFUL_S = 2
BACKLOG = 2048


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: they would replace the daemon's own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(address: str) -> socket.socket:
    """A listening TCP socket on ``HOST:PORT``; ``ValueError`` or ``OSError`` saying why not."""
    host, port = split_host_port(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {address}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket (the port it got, when 0 was asked for)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(front: FrontEnd, sock: socket.socket, stop: anyio.Event) -> None:
    """Serve the OpenAI-compatible routes on ``sock`` until ``stop`` is set."""
    from scheduler.http_api import build_app

    config = uvicorn.Config(
        build_app(front),
        lifespan="off",
        log_config=None,
        log_level="warning",
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=GRACEFUL_S,
        backlog=BACKLOG,
    )
    server = _Server(config)

    async def stop_when_asked() -> None:
        await stop.wait()
        server.should_exit = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_when_asked)
        await server.serve(sockets=[sock])
        tg.cancel_scope.cancel()
