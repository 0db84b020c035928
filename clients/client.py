"""``AsyncClient``: the anyio client over a ZeroMQ DEALER socket.

One socket carries any number of requests in flight, shared by callers in many tasks; ZeroMQ's
asyncio integration needs anyio's asyncio backend. The connection (the socket, the pump that
routes replies, the watch that ends calls when the daemon goes) is ``connection.Connection``; this
module is the calls: ``health``, ``stats``, ``wait_ready``, ``cancel``, ``stream``, ``generate``.
``health``, ``stats`` and ``cancel`` have a default timeout; streams have none by default.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, overload

import anyio
from anyio.abc import TaskGroup

from clients.connection import Connection, address_problem, raise_local_failure
from clients.events import ClientError, EndEvent, Event, RequestError, Result, event_from_message
from clients.messages import simple_message, submit_message
from clients.parse import expand_n, parse_response_format
from clients.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_GROUP_SIZE,
    ErrorCode,
    MsgType,
    ProtocolError,
    SamplingOptions,
    Submit,
)
from clients.tools import parse_tools

#: Seconds ``health``, ``stats`` and ``cancel`` wait when neither the call nor the client sets a
#: timeout. Streams and ``generate`` have none by default: a long generation is legitimate, and a
#: daemon that goes away ends them with ``daemon_gone``.
DEFAULT_CALL_TIMEOUT = 10.0

#: One ``generate_many`` job's place in its list with ``return_errors``: its result or its error.
Outcome = Result | RequestError | TimeoutError


class AsyncClient(Connection):
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
        """``timeout`` bounds every call (streams included) that does not give its own; without it,
        ``health``, ``stats`` and ``cancel`` wait ``DEFAULT_CALL_TIMEOUT`` seconds and streams are
        unbounded. ``curve_secret`` (your ``NAME.key_secret``) and ``server_key`` (the daemon's
        public key file) authenticate and encrypt the connection with CURVE; give both or neither."""
        super().__init__(address, max_frame_bytes=max_frame_bytes, curve_secret=curve_secret, server_key=server_key)
        self.timeout = timeout

    async def _call(self, kind: MsgType, timeout: float | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        rid = uuid.uuid4().hex
        recv = self._open_route(rid)
        try:
            with anyio.fail_after(self._limit(timeout, DEFAULT_CALL_TIMEOUT)):
                await self._send({**simple_message(kind, rid), **(extra or {})})
                reply = await recv.get()
            raise_local_failure(reply)
            if reply.get("type") == "error":
                raise RequestError(str(reply.get("code")), str(reply.get("message")), rid)
            return reply
        finally:
            self._close_route(rid)

    def _limit(self, timeout: float | None, default: float | None) -> float | None:
        """The call's own timeout, else the client's, else ``default``."""
        if timeout is not None:
            return timeout
        return self.timeout if self.timeout is not None else default

    # ------------------------------------------------------------------ API

    async def health(self, timeout: float | None = None) -> dict[str, Any]:
        """The daemon's status, model and limits. Answered once the model is loaded."""
        return await self._call(MsgType.HEALTH, timeout)

    async def stats(self, timeout: float | None = None) -> dict[str, Any]:
        """Counters from the front end and the engine."""
        return (await self._call(MsgType.STATS, timeout))["stats"]

    async def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Block until the daemon answers health with status ``ready`` (the ready handshake). A
        daemon that is gone may be restarted meanwhile, so ``daemon_gone`` is waited out too."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"daemon at {self.address} not ready after {timeout}s")
            try:
                health = await self.health(timeout=remaining)
            except TimeoutError:
                continue
            except RequestError as exc:
                if exc.code != ErrorCode.DAEMON_GONE:
                    raise
                health = {}
            if health.get("status") == "ready":
                return health
            await anyio.sleep(0.05)

    async def cancel(self, request_id: str, timeout: float | None = None) -> None:
        """Ask the daemon to stop a request; its stream then ends with ``cancelled``."""
        await self._send(simple_message(MsgType.CANCEL, request_id), self._limit(timeout, DEFAULT_CALL_TIMEOUT))

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
        top_logprobs: int = 0,
        priority: int = 0,
        request_id: str | None = None,
        timeout: float | None = None,
        group: tuple[str, int] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        response_format: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> AsyncGenerator[Event, None]:
        """Submit a job and yield its events: ``TokenEvent`` s, then exactly one ``EndEvent``.

        ``top_logprobs`` (0 to 20) adds, per token, that many most likely tokens with their logprobs
        (``TokenEvent.top_logprobs``) and implies ``logprobs``. ``priority`` orders the job among its
        tenant's waiting ones (higher first; the daemon accepts [-1000, 1000], capped by the tenant's
        ceiling). ``group=(name, size)`` says this is one of ``size`` requests sent together under
        ``name`` (``generate_many`` sets it): the daemon starts a held wave once the group is whole
        instead of waiting for a quiet gap. Leaving the loop early cancels the request. ``timeout``
        bounds the whole request; when it passes, the request is cancelled and ``TimeoutError``
        raised. ``RequestError`` is raised, with no ``EndEvent``, when the daemon goes away
        (``daemon_gone``) or the client is closed (``closed``) meanwhile.

        Logits controls, per sequence (a batch's other sequences are untouched): ``presence_penalty``
        and ``frequency_penalty`` in [-2, 2] (over every token generated so far, as OpenAI's),
        ``repetition_penalty`` in (0, 10] (over the prompt and every generated token, as vLLM's), ``logit_bias`` (token id -> bias in [-100, 100]), ``min_tokens`` (no
        end-of-sequence or stop token before that many tokens) and ``ignore_eos``.

        Structured output: ``response_format`` as the wire takes it, e.g. ``{"type": "json_schema",
        "schema": {...}}``, ``{"type": "json_object"}``, ``{"type": "regex", "pattern": "..."}`` or
        ``{"type": "grammar", "grammar": "<lark>"}``; the tokens follow it (``docs/protocol.md``).

        Tools: ``tools`` (OpenAI's function tools), ``tool_choice`` (``"auto"``, ``"none"``,
        ``"required"`` or ``{"type": "function", "function": {"name": ...}}``) and
        ``parallel_tool_calls``, as OpenAI's API takes them (``clients.tools``); the calls come back
        parsed in ``TokenEvent.tool_calls`` and ``Result.tool_calls``.
        """
        req = Submit(
            id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            tokens=tokens,
            messages=messages,
            max_tokens=max_tokens,
            sampling=SamplingOptions(
                temperature,
                top_p,
                top_k,
                min_p,
                seed,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                repetition_penalty=repetition_penalty,
                logit_bias=tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items())),
                min_tokens=min_tokens,
                ignore_eos=ignore_eos,
                response_format=parse_response_format(None if response_format is None else dict(response_format), None),
            ),
            stop=list(stop or []),
            stop_token_ids=list(stop_token_ids or []),
            logprobs=logprobs or top_logprobs > 0,
            top_logprobs=top_logprobs,
            priority=priority,
            group=group,
            batch=True,  # ``_reader`` unbatches
            tools=parse_tools(None if tools is None else list(tools), _plain(tool_choice), parallel_tool_calls),
        )
        recv = self._open_route(req.id)
        ended = False
        limit = self._limit(timeout, None)
        # The deadline is one timer for the whole request whose expiry arrives as a message
        # (``Connection._expire_route``), not a cancel scope around every wait for a message: at
        # thousands of tokens a second those scopes were ~30 % of this client's CPU. No scope may
        # span the generator's yields anyway: the blocking client steps it from different tasks.
        expiry = (
            None if limit is None else asyncio.get_running_loop().call_later(limit, self._expire_route, req.id, limit)
        )
        try:
            await self._send(submit_message(req), limit)
            while not ended:
                msg = await recv.get()  # one already routed is taken without a pass through the loop
                raise_local_failure(msg)
                event = event_from_message(msg)
                if event is None:
                    continue
                ended = isinstance(event, EndEvent)
                yield event
        finally:
            if expiry is not None:
                expiry.cancel()
            self._close_route(req.id)
            if not ended and self._sock is not None and self._problem() is None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    try:
                        await self.cancel(req.id)  # best effort: a daemon out of reach cancels nothing
                    except (ClientError, TimeoutError):
                        pass

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

    async def generate_n(self, prompt: str | None = None, *, n: int, **kwargs: Any) -> list[Result]:
        """``n`` sequences for one request (``protocol.expand_n``): ``n`` submits with ids
        ``<request_id>/<i>``, sent as one group so one prefill wave takes them, each seeded
        ``seed + i`` when ``seed`` is given. Results in order; an error in one cancels the others
        and is raised. The daemon prefills the prompt once for all of them where its prefix cache serves."""
        if "group" in kwargs:
            raise TypeError("generate_n declares the group itself")
        proto = Submit(
            id=kwargs.pop("request_id", None) or uuid.uuid4().hex,
            prompt=prompt,
            sampling=SamplingOptions(seed=kwargs.pop("seed", None)),
        )
        try:
            subs = expand_n(proto, n)
        except ProtocolError as exc:
            raise ValueError(exc.message) from None
        results: list[Result | None] = [None] * len(subs)

        async def one(i: int) -> None:
            sub = subs[i]
            results[i] = await self.generate(
                prompt, request_id=sub.id, seed=sub.sampling.seed, group=sub.group, **kwargs
            )

        await _run_all(len(subs), one)
        return [r for r in results if r is not None]

    @overload
    async def generate_many(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        concurrency: int | None = None,
        return_errors: Literal[False] = False,
    ) -> list[Result]: ...

    @overload
    async def generate_many(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        concurrency: int | None = None,
        return_errors: Literal[True],
    ) -> list[Outcome]: ...

    async def generate_many(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        concurrency: int | None = None,
        return_errors: bool = False,
    ) -> list[Result] | list[Outcome]:
        """Run many jobs at once on this connection; each is ``generate``'s keyword arguments
        (``{"prompt": "...", "max_tokens": 64}``), and the results come back in the order given.

        Every job is sent from one task group and declared one group (``stream``'s ``group``), so a
        batch reaches the daemon within milliseconds and an idle daemon prefills it as one wave as soon
        as its last member arrives; threads each calling ``Client.generate`` spread their sends over
        tens of milliseconds, and the daemon can only wait for a quiet gap (128 of them split into two
        waves, a few percent slower).
        ``concurrency`` caps the jobs in flight (default ``DEFAULT_CONCURRENCY``, the daemon's default
        ``max_inflight_per_client``): the daemon ends jobs past its limits with ``busy``, and cuts a
        connection that sends thousands of messages faster than it reads them.
        A job that ends with an error (``RequestError``, or ``TimeoutError`` from its ``timeout``)
        cancels the others and is raised, unless ``return_errors``: then the error takes that job's
        place in the list. Every job's arguments are checked before any is sent."""
        jobs = [_job_kwargs(i, r) for i, r in enumerate(requests)]
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        concurrency = min(len(jobs), concurrency or DEFAULT_CONCURRENCY) or None
        # The jobs sent at once are declared as one group; those started later, as slots free, are
        # not (the daemon's window gathers the ones that free together).
        first = min(len(jobs), concurrency or len(jobs))
        if first <= MAX_GROUP_SIZE:
            name = uuid.uuid4().hex
            for job in jobs[:first]:
                job["group"] = (name, first)
        limiter = anyio.CapacityLimiter(concurrency) if concurrency and concurrency < len(jobs) else None
        results: list[Outcome | None] = [None] * len(jobs)

        async def one(i: int) -> None:
            try:
                if limiter is None:
                    results[i] = await self.generate(**jobs[i])
                else:
                    async with limiter:
                        results[i] = await self.generate(**jobs[i])
            except (RequestError, TimeoutError) as exc:
                if not return_errors:
                    raise
                results[i] = exc

        await _run_all(len(jobs), one)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]


#: Jobs ``generate_many`` keeps in flight unless told: the daemon's default ``max_inflight_per_client``.
DEFAULT_CONCURRENCY = 256

#: What one job of ``generate_many`` may set: ``stream``'s keyword arguments.
_JOB_KEYS = frozenset(name for name, p in inspect.signature(AsyncClient.stream).parameters.items() if name != "self")


async def _run_all(count: int, one: Callable[[int], Awaitable[None]]) -> None:
    """Run ``one(i)`` for every ``i < count`` at once; the first that raises cancels the others, and
    its exception is raised as itself (not in an exception group)."""
    failure: list[BaseException] = []

    async def run(i: int, group: TaskGroup) -> None:
        try:
            await one(i)
        except Exception as exc:
            failure.append(exc)
            group.cancel_scope.cancel()

    async with anyio.create_task_group() as group:
        for i in range(count):
            group.start_soon(run, i, group)
    if failure:
        raise failure[0]


def _plain(value: Any) -> Any:
    """A mapping as the dict the wire's checks read; anything else as it is."""
    return dict(value) if isinstance(value, Mapping) else value


def _job_kwargs(index: int, request: Any) -> dict[str, Any]:
    """One ``generate_many`` job as keyword arguments, with a one-line error for a malformed one."""
    if not isinstance(request, Mapping):
        raise TypeError(f"generate_many: job {index} is a {type(request).__name__}, not a mapping of arguments")
    unknown = sorted(str(k) for k in request if k not in _JOB_KEYS)
    if unknown:
        raise TypeError(f"generate_many: job {index} has unknown argument(s) {', '.join(unknown)}")
    if "group" in request:
        raise TypeError(f"generate_many: job {index} sets 'group'; generate_many declares the group itself")
    return dict(request)


__all__ = ["DEFAULT_CALL_TIMEOUT", "AsyncClient", "Outcome", "RequestError", "address_problem"]
