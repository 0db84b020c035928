"""``AsyncClient``: the anyio client over a ZeroMQ DEALER socket.

One socket carries any number of requests in flight. A reader task routes every incoming
message by id to the request (or the health/stats call) that waits for it, so callers in many
tasks share one connection. ZeroMQ's asyncio integration needs anyio's asyncio backend.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator
from types import TracebackType
from typing import Any

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from clients.address import default_address
from clients.events import ClientError, EndEvent, Event, RequestError, Result, event_from_message
from clients.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    MsgType,
    SamplingOptions,
    Submit,
    pack,
    simple_message,
    submit_message,
    unpack,
)


class AsyncClient:
    """Use as ``async with AsyncClient(addr) as client: await client.generate("...")``."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        curve_secret: str | None = None,
        server_key: str | None = None,
    ) -> None:
        """``curve_secret`` (your ``NAME.key_secret``) and ``server_key`` (the daemon's public key
        file) authenticate and encrypt the connection with CURVE; give both or neither."""
        self.address = address or default_address()
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        if (curve_secret is None) != (server_key is None):
            raise ClientError("give both curve_secret and server_key, or neither")
        self.curve_secret = curve_secret
        self.server_key = server_key
        self._auth_error: str | None = None
        self._routes: dict[str, MemoryObjectSendStream[dict[str, Any]]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tg: TaskGroup | None = None

    async def __aenter__(self) -> AsyncClient:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        monitor = self._setup_curve(self._sock) if self.curve_secret is not None else None
        self._sock.connect(self.address)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._reader)
        if monitor is not None:
            self._tg.start_soon(self._watch_handshakes, monitor)
        return self

    def _setup_curve(self, sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
        """CURVE keys on the socket, and a monitor so a refused handshake fails calls at once."""
        import zmq.auth

        try:
            public, secret = zmq.auth.load_certificate(str(self.curve_secret))
            server_public, _ = zmq.auth.load_certificate(str(self.server_key))
        except (OSError, ValueError) as exc:
            raise ClientError(f"cannot read CURVE keys: {exc}") from None
        if secret is None:
            raise ClientError(f"{self.curve_secret} holds no secret key (use NAME.key_secret)")
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public
        events = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_SUCCEEDED
        return sock.get_monitor_socket(events)

    async def _watch_handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._auth_error = None
                    continue
                self._auth_error = f"the daemon refused this client's CURVE key ({event['endpoint']!r})"
                for rid in list(self._routes):
                    self._routes[rid].send_nowait(
                        {"type": "error", "id": rid, "code": "unauthorized", "message": self._auth_error}
                    )
        finally:
            monitor.close(linger=0)

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None and self._sock is not None and self._ctx is not None
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(et, exc, tb)
        finally:
            self._sock.close()
            self._ctx.term()

    # ------------------------------------------------------------------ plumbing

    async def _reader(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = unpack(frames[-1], max_bytes=1 << 30)
            except Exception:
                continue  # nothing a well-behaved daemon sends; drop rather than die
            route = self._routes.get(str(msg.get("id")))
            if route is not None:
                try:
                    route.send_nowait(msg)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    self._routes.pop(str(msg.get("id")), None)

    async def _send(self, msg: dict[str, Any], timeout: float | None = None) -> None:
        """Send one message. A DEALER with no connected peer blocks on send (no daemon yet, or a
        refused handshake), so the send is bounded by the caller's timeout too."""
        if self._sock is None:
            raise ClientError("use the client as a context manager: `async with AsyncClient(...) as c:`")
        if self._auth_error is not None:
            raise RequestError("unauthorized", self._auth_error)
        frame = pack(msg)
        if len(frame) > self.max_frame_bytes:
            raise ClientError(f"message is {len(frame)} bytes; the daemon accepts at most {self.max_frame_bytes}")
        with anyio.fail_after(timeout):
            await self._sock.send(frame)

    def _open_route(self, rid: str) -> MemoryObjectReceiveStream[dict[str, Any]]:
        if rid in self._routes:
            raise ClientError(f"request id {rid!r} is already in flight on this client")
        send, recv = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
        self._routes[rid] = send
        return recv

    def _close_route(self, rid: str) -> None:
        route = self._routes.pop(rid, None)
        if route is not None:
            route.close()

    async def _call(self, kind: MsgType, timeout: float | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        rid = uuid.uuid4().hex
        recv = self._open_route(rid)
        try:
            with anyio.fail_after(self._timeout(timeout)):
                await self._send({**simple_message(kind, rid), **(extra or {})})
                reply = await recv.receive()
            if reply.get("type") == "error":
                raise RequestError(str(reply.get("code")), str(reply.get("message")), rid)
            return reply
        finally:
            self._close_route(rid)

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    # ------------------------------------------------------------------ API

    async def health(self, timeout: float | None = None) -> dict[str, Any]:
        """The daemon's status, model and limits. Answered once the model is loaded."""
        return await self._call(MsgType.HEALTH, timeout)

    async def stats(self, timeout: float | None = None, measure_tax: bool = False) -> dict[str, Any]:
        """Counters from the front end and the engine. ``measure_tax`` asks the engine to time a
        batched step pinned vs wide; the result shows in later replies (``engine.pin_tax``)."""
        extra = {"measure_tax": True} if measure_tax else None
        return (await self._call(MsgType.STATS, timeout, extra))["stats"]

    async def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Block until the daemon answers health with status ``ready`` (the ready handshake)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"daemon at {self.address} not ready after {timeout}s")
            try:
                health = await self.health(timeout=remaining)
            except TimeoutError:
                continue
            if health.get("status") == "ready":
                return health
            await anyio.sleep(0.05)

    async def cancel(self, request_id: str, timeout: float | None = 5.0) -> None:
        """Ask the daemon to stop a request; its stream then ends with ``cancelled``."""
        await self._send(simple_message(MsgType.CANCEL, request_id), timeout)

    async def stream(
        self,
        prompt: str | None = None,
        *,
        tokens: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        logprobs: bool = False,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerator[Event, None]:
        """Submit a job and yield its events: ``TokenEvent`` s, then exactly one ``EndEvent``.

        Leaving the loop early cancels the request. ``timeout`` bounds the whole request; when
        it passes, the request is cancelled and ``TimeoutError`` raised.
        """
        req = Submit(
            id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            tokens=tokens,
            messages=messages,
            max_tokens=max_tokens,
            sampling=SamplingOptions(temperature, top_p, top_k, min_p, seed),
            stop=list(stop or []),
            stop_token_ids=list(stop_token_ids or []),
            logprobs=logprobs,
        )
        recv = self._open_route(req.id)
        ended = False
        limit = self._timeout(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        try:
            await self._send(submit_message(req), limit)
            while not ended:
                # The timeout wraps each receive, never a yield, so the generator can be
                # stepped from different tasks (as the blocking client does).
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                with anyio.fail_after(remaining):
                    msg = await recv.receive()
                event = event_from_message(msg)
                if event is None:
                    continue
                ended = isinstance(event, EndEvent)
                yield event
        finally:
            self._close_route(req.id)
            if not ended and self._sock is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    await self.cancel(req.id)  # best effort: a daemon out of reach cancels nothing

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """Run a job to its end. Raises ``RequestError`` if the daemon ended it with an error."""
        result: Result | None = None
        async for event in self.stream(prompt, **kwargs):
            if result is None:
                result = Result(event.request_id)
            if isinstance(event, EndEvent) and event.error is not None:
                raise event.error
            result.add(event)
        assert result is not None
        return result


__all__ = ["AsyncClient", "RequestError"]
