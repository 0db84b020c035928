"""``n`` choices for one OpenAI request: ``n`` sequences on one in-process connection, merged.

The request's ``n`` submits (``protocol.expand_n``: ids ``<rid>/<i>``, one declared group, seeds
``seed + i``) share the connection, so their events arrive interleaved on it; each is routed to its
choice by id. A whole answer waits for every sequence's end; a stream first waits for every
sequence's first event (so a refusal is still an HTTP error, not a broken stream), then sends each
choice's chunks as they come, each choice's finish chunk when it ends, and the usage chunk and
``[DONE]`` after the last. The engine prefills their prompt once (``workers.engine.shared_prefill``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.requests import Request

from scheduler.http_openai import from_protocol
from scheduler.http_shapes import DONE, Reply, sse, usage_of_all, whole_of_all
from scheduler.local import LocalConnection

#: Raises the HTTP error for a wire message that ended a request before its answer began.
RaiseFor = Callable[[dict[str, Any]], None]


def _ends(msg: dict[str, Any]) -> bool:
    return msg.get("type") != "token"


async def read_until(conn: LocalConnection, request: Request, enough: Callable[[dict[str, Any]], bool]) -> bool:
    """Hand ``conn``'s events to ``enough`` until it says enough was read, or the events end; False
    when the client disconnected first (the read stops there)."""
    gone = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        async for msg in conn.events:
            if enough(msg):
                break
        tg.cancel_scope.cancel()
    return not gone


async def _gather(
    conn: LocalConnection, request: Request, index: dict[str, int], *, whole: bool
) -> list[list[dict[str, Any]]] | None:
    """Each choice's events: every one up to its end (``whole``), else until each has one.
    ``None`` when the client disconnected first."""
    got: list[list[dict[str, Any]]] = [[] for _ in index]

    def complete() -> bool:
        return all(g and (not whole or _ends(g[-1])) for g in got)

    def take(msg: dict[str, Any]) -> bool:
        i = index.get(str(msg.get("id")))
        if i is None or (got[i] and _ends(got[i][-1])):
            return False
        got[i].append(msg)
        return complete()

    return got if await read_until(conn, request, take) and complete() else None


async def answer(
    conn: LocalConnection, request: Request, ids: list[str], replies: list[Reply], stream: bool, raise_for: RaiseFor
) -> dict[str, Any] | AsyncIterator[bytes] | None:
    """The whole answer, the stream's chunks, or ``None`` when the client went away. A sequence
    refused or failed before the answer began raises its HTTP error (the connection's closing then
    cancels the others)."""
    index = {rid: i for i, rid in enumerate(ids)}
    got = await _gather(conn, request, index, whole=not stream)
    if got is None:
        return None
    for msgs in got:
        last = msgs[-1]
        if _ends(last):
            raise_for(last)
    if not stream:
        return whole_of_all(replies, got)
    return _chunks(conn, index, replies, got)


async def _chunks(
    conn: LocalConnection, index: dict[str, int], replies: list[Reply], got: list[list[dict[str, Any]]]
) -> AsyncIterator[bytes]:
    for reply in replies:
        opening = reply.first_chunk()
        if opening is not None:
            yield sse(opening)
    ends: dict[int, dict[str, Any]] = {}
    pending = [(i, msg) for i, msgs in enumerate(got) for msg in msgs]
    while True:
        for i, msg in pending:
            if i in ends:
                continue
            reply = replies[i]
            if not _ends(msg):
                for chunk in reply.token_chunks(msg):
                    yield sse(chunk)
                continue
            err = msg.get("error") if msg["type"] == "end" else msg
            if err:
                code = str(err.get("code") or "engine_error")
                yield sse(from_protocol(code, str(err.get("message") or code), chat=reply.chat).body())
                yield DONE
                return
            ends[i] = msg
            for chunk in reply.finish_chunks(msg):
                yield sse(chunk)
        if len(ends) == len(replies):
            break
        try:
            msg = await conn.events.receive()
        except anyio.EndOfStream:
            return
        i = index.get(str(msg.get("id")), -1)
        pending = [] if i < 0 else [(i, msg)]
    if replies[0].include_usage:
        usage = usage_of_all([ends[i] for i in range(len(replies))])
        yield sse({**replies[0].final_chunks(ends[0], usage)[-1]})
    yield DONE
