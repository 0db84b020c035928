"""``Client``: the blocking client, the async one run in a private event-loop thread.

Running the one ``AsyncClient`` in a loop of its own keeps a single implementation of the
protocol, and makes the blocking client safe to share between threads: every call is handed to
that loop, which owns the socket.

The loop runs in a daemon thread that nothing joins at exit, so a client that is never closed
does not keep the interpreter alive. Each call is a task in that loop, handed over without
blocking, so a thread interrupted while it waits (Ctrl-C) always knows its task and cancels it,
and so its request, before the interrupt goes on.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import CancelledError, Future, InvalidStateError
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from clients.client import AsyncClient, Outcome
from clients.events import ClientError, Event, RequestError, Result
from clients.protocol import ErrorCode

T = TypeVar("T")

#: Seconds an interrupted call gets to cancel its request (a stream sends its cancel, bounded
#: by 1 s) before the interrupt propagates.
INTERRUPT_GRACE_S = 1.5
#: Seconds ``close()`` waits for the connection to close, and then for the loop thread to end.
CLOSE_GRACE_S = 1.5


class _Job:
    """One call to run in the loop. ``future`` carries its outcome to the calling thread; cancelling
    it cancels the task; ``finished`` is set once the task has cleaned up, however it ended."""

    def __init__(self, func: Callable[[], Awaitable[Any]]) -> None:
        self.func = func
        self.future: Future[Any] = Future()
        self.finished = threading.Event()

    async def run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            if self.future.cancelled():
                return
            with anyio.CancelScope() as scope:
                self.future.add_done_callback(lambda f: _cancel_soon(loop, scope) if f.cancelled() else None)
                try:
                    value = await self.func()
                except Exception as exc:
                    _settle(self.future, exc=exc)
                else:
                    _settle(self.future, value=value)
        finally:
            self.future.cancel()  # a no-op once settled; else the loop is stopping: the caller hears ``closed``
            self.finished.set()

    def refuse(self) -> None:
        """The loop takes no more jobs: end this one before it starts."""
        self.future.cancel()
        self.finished.set()


def _cancel_soon(loop: asyncio.AbstractEventLoop, scope: anyio.CancelScope) -> None:
    try:
        loop.call_soon_threadsafe(scope.cancel)
    except RuntimeError:
        pass  # the loop has ended, and the task with it


def _settle(future: Future[Any], value: Any = None, exc: BaseException | None = None) -> None:
    """Give ``future`` its outcome, unless the caller cancelled it meanwhile."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)
    except InvalidStateError:
        pass


class _LoopThread:
    """An anyio (asyncio) event loop in a daemon thread, taking ``_Job`` s from other threads."""

    def __init__(self) -> None:
        ready: Future[tuple[asyncio.AbstractEventLoop, MemoryObjectSendStream[_Job]]] = Future()
        self._thread = threading.Thread(target=self._main, args=(ready,), name="mlx-batchd-client", daemon=True)
        self._thread.start()
        self._loop, self._jobs = ready.result()

    def _main(self, ready: Future[tuple[asyncio.AbstractEventLoop, MemoryObjectSendStream[_Job]]]) -> None:
        async def serve() -> None:
            loop = asyncio.get_running_loop()
            send, receive = anyio.create_memory_object_stream[_Job](math.inf)
            ready.set_result((loop, send))
            async with anyio.create_task_group() as tg, receive:
                async for job in receive:
                    tg.start_soon(job.run, loop)
                tg.cancel_scope.cancel()  # stopped: whatever still runs is cancelled

        try:
            anyio.run(serve, backend="asyncio")
        except BaseException as exc:  # the constructor waits on ``ready``: hand it the reason
            if not ready.done():
                ready.set_exception(exc)

    def submit(self, func: Callable[[], Awaitable[T]]) -> _Job:
        """Start ``func()`` in the loop without waiting for the loop (so nothing can interrupt the
        hand-over half-way). Raises ``RuntimeError`` once the loop is stopped."""
        job = _Job(func)
        self._loop.call_soon_threadsafe(self._accept, job)
        return job

    def _accept(self, job: _Job) -> None:
        try:
            self._jobs.send_nowait(job)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            job.refuse()

    def call_soon(self, func: Callable[[], object]) -> None:
        """Run ``func`` in the loop soon, if the loop still runs."""
        try:
            self._loop.call_soon_threadsafe(func)
        except RuntimeError:
            pass

    def stop(self, within: float) -> None:
        """Cancel what still runs and end the thread, waiting at most ``within`` seconds."""
        try:
            self._loop.call_soon_threadsafe(self._jobs.close)
        except RuntimeError:
            pass  # the loop has ended already
        self._thread.join(timeout=within)


class Client:
    """Use as ``with Client(addr) as client: client.generate("...")``, or call ``close()``.

    Takes the same arguments as ``AsyncClient``. Safe to share between threads, ``close()`` included.
    """

    def __init__(self, address: str | None = None, **kwargs: Any) -> None:
        self._client = AsyncClient(address, **kwargs)
        self.address = self._client.address
        self._lock = threading.Lock()
        self._closed = False
        self._loop = _LoopThread()
        entered: Future[None] = Future()
        self._release: anyio.Event | None = None
        self._held = self._loop.submit(lambda: self._hold(entered))
        try:
            entered.result()
        except BaseException:
            self._held.future.cancel()
            self._loop.stop(CLOSE_GRACE_S)
            raise

    async def _hold(self, entered: Future[None]) -> None:
        """Keep the client open (entered and left in this one task, as anyio requires) until
        ``close()``: a task of its own, so no call's cancellation can close it."""
        try:
            await self._client.__aenter__()
        except BaseException as exc:
            entered.set_exception(exc)
            raise
        try:
            self._release = anyio.Event()
            entered.set_result(None)
            await self._release.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await self._client.__aexit__(None, None, None)

    def close(self) -> None:
        """Close the connection, from any thread, within about 2 s. Calls still in flight on this
        client raise ``RequestError("closed")``; the daemon notices the connection is gone and
        cancels their requests."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        release = self._release
        if release is not None:
            self._loop.call_soon(release.set)
        self._held.finished.wait(CLOSE_GRACE_S)
        self._loop.stop(CLOSE_GRACE_S)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _run(self, func: Callable[[], Awaitable[T]]) -> T:
        """Run ``func()`` as a task in the loop and wait for it. If this thread is interrupted while
        waiting, the task is cancelled and given ``INTERRUPT_GRACE_S`` to clean up (a stream sends
        its cancel) before the interrupt propagates."""
        if self._closed:
            raise RequestError(ErrorCode.CLOSED, "this client is closed")
        try:
            job = self._loop.submit(func)
        except RuntimeError:
            raise RequestError(ErrorCode.CLOSED, "this client is closed") from None
        try:
            return job.future.result()
        except CancelledError:
            raise RequestError(ErrorCode.CLOSED, "the client was closed while this call was in flight") from None
        except BaseException:
            if job.future.cancel():
                job.finished.wait(INTERRUPT_GRACE_S)
            raise

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        return self._run(lambda: self._client.health(timeout))

    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self._run(lambda: self._client.stats(timeout))

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        return self._run(lambda: self._client.wait_ready(timeout))

    def cancel(self, request_id: str, timeout: float | None = None) -> None:
        self._run(lambda: self._client.cancel(request_id, timeout))

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """See ``AsyncClient.generate``."""
        return self._run(lambda: self._client.generate(prompt, **kwargs))

    def generate_n(self, prompt: str | None = None, *, n: int, **kwargs: Any) -> list[Result]:
        """See ``AsyncClient.generate_n``."""
        return self._run(lambda: self._client.generate_n(prompt, n=n, **kwargs))

    @overload
    def generate_many(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        concurrency: int | None = None,
        return_errors: Literal[False] = False,
    ) -> list[Result]: ...

    @overload
    def generate_many(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        concurrency: int | None = None,
        return_errors: Literal[True],
    ) -> list[Outcome]: ...

    def generate_many(
        self, requests: Iterable[Mapping[str, Any]], *, concurrency: int | None = None, return_errors: bool = False
    ) -> list[Result] | list[Outcome]:
        """See ``AsyncClient.generate_many``: every job is sent from the client's one event loop, so a
        batch reaches the daemon together (threads each calling ``generate`` spread their sends)."""
        jobs = list(requests)
        if return_errors:
            return self._run(lambda: self._client.generate_many(jobs, concurrency=concurrency, return_errors=True))
        return self._run(lambda: self._client.generate_many(jobs, concurrency=concurrency))

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Event]:
        """See ``AsyncClient.stream``; leaving the loop early (Ctrl-C included) cancels the request.

        The stream's own cleanup sends the cancel. An interrupt that lands between handing a step to
        the loop and waiting for it leaves that step running, and a running generator cannot be
        closed (``RuntimeError``): then the request is cancelled by its id instead (seen in CI, where
        a Ctrl-C'd stream's request otherwise ran out its tokens)."""
        request_id = kwargs.pop("request_id", None) or uuid.uuid4().hex
        agen = self._client.stream(prompt, request_id=request_id, **kwargs)
        try:
            while True:
                try:
                    event = self._run(agen.__anext__)
                except StopAsyncIteration:
                    return
                yield event
        finally:
            if not sys.is_finalizing():  # collected at exit, the loop thread is frozen: skip
                try:
                    self._run(agen.aclose)
                except RuntimeError:
                    self._cancel_quietly(request_id)
                except ClientError:
                    pass  # closed meanwhile: its socket and the request are gone

    def _cancel_quietly(self, request_id: str) -> None:
        """Best effort: a closed client or a daemon out of reach cancels nothing."""
        try:
            self._run(lambda: self._client.cancel(request_id, 1.0))
        except (ClientError, RuntimeError, TimeoutError):
            pass
