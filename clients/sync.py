"""``Client``: the blocking client, the async one run in a private event-loop thread.

Running the one ``AsyncClient`` behind an anyio blocking portal keeps a single implementation of
the protocol, and makes the blocking client safe to share between threads: every call is handed
to the portal's loop, which owns the socket.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from types import TracebackType
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

from clients.client import AsyncClient
from clients.events import Event, Result


class Client:
    """Use as ``with Client(addr) as client: client.generate("...")``, or call ``close()``."""

    def __init__(self, address: str | None = None, **kwargs: Any) -> None:
        self._stack = ExitStack()
        self._portal: BlockingPortal = self._stack.enter_context(start_blocking_portal(backend="asyncio"))
        cm: AbstractContextManager[AsyncClient] = self._portal.wrap_async_context_manager(
            AsyncClient(address, **kwargs)
        )
        try:
            self._client = self._stack.enter_context(cm)
        except BaseException:
            self._stack.close()
            raise
        self.address = self._client.address

    def close(self) -> None:
        """Close the connection. Requests still streaming are abandoned; the daemon notices the
        connection is gone and cancels them."""
        self._stack.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        return self._portal.call(self._client.health, timeout)

    def stats(self, timeout: float | None = None, measure_tax: bool = False) -> dict[str, Any]:
        return self._portal.call(self._client.stats, timeout, measure_tax)

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        return self._portal.call(self._client.wait_ready, timeout)

    def cancel(self, request_id: str) -> None:
        self._portal.call(self._client.cancel, request_id)

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """See ``AsyncClient.generate``."""
        return self._portal.call(lambda: self._client.generate(prompt, **kwargs))

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Event]:
        """See ``AsyncClient.stream``; leaving the loop early cancels the request."""
        agen = self._client.stream(prompt, **kwargs)
        try:
            while True:
                try:
                    event = self._portal.call(agen.__anext__)
                except StopAsyncIteration:
                    return
                yield event
        finally:
            try:
                self._portal.call(agen.aclose)
            except RuntimeError:
                pass  # the client was closed mid-stream: its socket (and the request) are gone already
