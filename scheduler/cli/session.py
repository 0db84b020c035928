"""A client for one command, and what Ctrl-C does to it.

The interrupt can land in the middle of a client call, and a daemon that is gone cannot answer a
cancel, so every wait after Ctrl-C is bounded by ``CLOSE_WITHIN_S``: the command exits promptly
whatever state the connection is in, and a request it started is cancelled on the daemon when the
daemon is there to hear it.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients import Client

#: After Ctrl-C, how long cancelling the request and closing the connection may take before the
#: command exits anyway (a daemon that is gone must not keep the terminal).
CLOSE_WITHIN_S = 2.0


def client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Client`` keyword arguments of the CURVE options (``options.add_client_auth``)."""
    return {"curve_secret": args.curve_secret, "server_key": args.server_key}


@contextlib.contextmanager
def open_client(args: argparse.Namespace, request_id: str | None = None, **kwargs: Any) -> Iterator[Client]:
    """A ``Client`` for one command, closed on the way out. After Ctrl-C, ``request_id`` is
    cancelled and the client closed by a helper thread given ``CLOSE_WITHIN_S``: the interrupt can
    land in the middle of a call, and a daemon that is gone cannot answer the cancel, so waiting
    for either without a bound could keep the command from exiting."""
    from clients import Client

    client = Client(args.addr, **client_kwargs(args), **kwargs)
    try:
        yield client
    except KeyboardInterrupt:
        _cancel_and_close(client, request_id, CLOSE_WITHIN_S)
        raise
    except BaseException:
        client.close()
        raise
    client.close()


def _cancel_and_close(client: Client, request_id: str | None, within: float) -> None:
    def finish() -> None:
        if request_id is not None:
            with contextlib.suppress(Exception):
                client.cancel(request_id)
        with contextlib.suppress(Exception):
            client.close()

    worker = threading.Thread(target=finish, name="mlx-batchd-cancel", daemon=True)
    worker.start()
    worker.join(within)


class CancelOnInterrupt:
    """While active, Ctrl-C cancels ``request_id`` through the daemon instead of raising in the
    middle of a client call: the stream then ends (``cancelled``) the ordinary way, and the client
    closes with nothing left half-done. A second Ctrl-C, or no end within ``grace`` seconds (a
    daemon that is gone cannot confirm), raises ``KeyboardInterrupt`` as usual (``open_client``)."""

    def __init__(self, client: Client, request_id: str, grace: float = CLOSE_WITHIN_S) -> None:
        self.client = client
        self.request_id = request_id
        self.grace = grace
        self.interrupted = False
        self._timer: threading.Timer | None = None
        self._previous: Any = None

    def __enter__(self) -> CancelOnInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)
        if self._timer is not None:
            self._timer.cancel()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        threading.Thread(target=self._cancel, name="mlx-batchd-cancel", daemon=True).start()
        # A real signal, aimed at the main thread, so it also wakes a call blocked there.
        main = threading.main_thread().ident
        assert main is not None
        self._timer = threading.Timer(self.grace, signal.pthread_kill, (main, signal.SIGINT))
        self._timer.daemon = True
        self._timer.start()

    def _cancel(self) -> None:
        with contextlib.suppress(Exception):
            self.client.cancel(self.request_id)
