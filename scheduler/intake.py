"""A message's way in, and a submit's way to the fair queue.

``Intake`` reads every message from the socket, decodes and validates it, finds its tenant from
the CURVE key (never from anything the client says) and routes it: ``cancel`` to ``Control``,
``health`` and ``stats`` to their replies, and ``submit`` along the admission path. A submit is
checked against the connection's, the tenant's and the daemon's limits (a tenant below its share
of a full queue takes the place of the newest request of the tenant holding the most), tokenized
off the loop (in parallel, tenants taking turns: ``scheduler.tokenizing``), admitted (``scheduler.admission``) against the model and the tenant,
turned into the engine's ``Job`` and checked against the whole KV budget; then ``Flight`` queues
it. In-process connections (``scheduler.local``) enter here too, after their own tenant check.
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from anyio.abc import TaskGroup

from clients.messages import error_message
from clients.parse import parse_request
from clients.protocol import Cancel, ErrorCode, FinishReason, Health, MsgType, ProtocolError, Stats, Submit, unpack
from scheduler import tool_calls
from scheduler.admission import Admitted, admit, prompt_ids
from scheduler.chat_reply import Answer
from scheduler.control import Control
from scheduler.flight import Flight
from scheduler.outputs import refused_submit_end
from scheduler.requests import Tracked
from scheduler.response_format import grammar_of
from scheduler.settings import FrontEndSettings, request_kv_budget
from scheduler.stats import Counters
from scheduler.stopping import StopStrings
from scheduler.tenants import LOCAL, Tenant
from scheduler.tokenizing import FairTokenizer
from scheduler.transport import Transport
from workers.api import Job, SamplingParams, salt_for

SHUTTING_DOWN = (ErrorCode.SHUTDOWN, "the daemon is shutting down; no new requests")


class Intake:
    """Messages in, and submits through the limits, tokenizing and admission to the fair queue.

    ``tasks`` is the front end's task group (tokenizing runs in tasks of it); it is given before
    the first message is read."""

    tasks: TaskGroup

    def __init__(
        self, settings: FrontEndSettings, flight: Flight, transport: Transport, control: Control, counters: Counters
    ) -> None:
        self.settings = settings
        self._flight = flight
        self._transport = transport
        self._control = control
        self._counters = counters
        self._send = transport.send
        self._tokenizer = FairTokenizer()
        #: Requests that arrived while the model loaded, admitted once it is ready (``on_ready``).
        self._early: list[Tracked] = []

    # ------------------------------------------------------------------ the socket

    async def receive(self) -> None:
        """Read and route messages until cancelled, from the start: while the model loads, health
        answers ``loading`` and submits wait for ``on_ready`` (reading at once keeps a client from
        filling the socket's queue, and stopping its input, while a model loads for minutes)."""
        transport = self._transport
        while True:
            frames = await transport.receive()
            self._counters.received += 1
            client = frames[0].bytes
            if len(frames) != 2:
                self._refuse(
                    client, ProtocolError(ErrorCode.BAD_FRAMES, f"send one frame per message, got {len(frames) - 1}")
                )
                continue
            msg: dict[str, Any] | None = None
            try:
                msg = unpack(frames[1].bytes, self.settings.max_frame_bytes)
                req = parse_request(msg)
            except ProtocolError as exc:
                if not transport.outbox_full(client):
                    self._refuse_message(client, exc, msg)
                else:
                    self._counters.messages_dropped += 1
                continue
            if transport.outbox_full(client) and not isinstance(req, Cancel):
                self._counters.messages_dropped += 1  # it is not reading: answers would only pile up
                continue
            tenant = self.tenant_of(frames[1])
            if tenant is None:
                self._refuse(
                    client, ProtocolError(ErrorCode.UNAUTHORIZED, "this key no longer belongs to any tenant", req.id)
                )
                continue
            if isinstance(req, Submit):
                if req.batch:
                    transport.mark_batching(client)
                self.submit(client, tenant, req)
            elif isinstance(req, Cancel):
                self.cancel(tenant, client, req.id)
            elif isinstance(req, Health):
                self._send(client, self._control.health(req.id))
            elif isinstance(req, Stats):
                try:
                    reply = self._control.stats_reply(tenant, req)
                except ProtocolError as exc:
                    self._refuse(client, exc)
                else:
                    self._send(client, reply)

    def tenant_of(self, frame: zmq.Frame) -> Tenant | None:
        """Who sent this: the CURVE key's tenant (the ZAP User-Id, never anything the client
        says), or ``local`` when no tenants file is in force."""
        table = self._flight.table
        if not table.authenticated:
            return table.tenants[LOCAL]
        return table.by_key(str(frame.get("User-Id")))

    def _refuse_message(self, client: bytes, exc: ProtocolError, msg: dict[str, Any] | None) -> None:
        """A submit with a readable, unused id ends as a request (one ``end`` with the error), so
        a client waiting on that id gets its answer; anything else is an ``error`` event."""
        rid = exc.request_id
        if (
            msg is not None
            and msg.get("type") == MsgType.SUBMIT
            and rid is not None
            and not self._flight.requests.has_rid(client, rid)
        ):
            self._counters.refused += 1
            self._send(client, refused_submit_end(rid, (exc.code, exc.message)))
            return
        self._refuse(client, exc)

    def _refuse(self, client: bytes, exc: ProtocolError) -> None:
        """A message that cannot start a request: an ``error`` event, addressed by id if it had one."""
        self._counters.refused += 1
        self._send(client, error_message(exc.code, exc.message, exc.request_id))

    # ------------------------------------------------------------------ in-process connections

    def submit_local(self, client: bytes, tenant_name: str, req: Submit) -> None:
        """A submit from an in-process connection; its tenant may have been removed by a reload."""
        if not self._transport.is_local(client):
            raise RuntimeError("submit on a closed local connection")
        tenant = self._flight.table.tenants.get(tenant_name)
        if tenant is None:
            exc = ProtocolError(ErrorCode.UNAUTHORIZED, f"tenant {tenant_name!r} no longer exists", req.id)
            self._refuse_message(client, exc, {"type": MsgType.SUBMIT.value})
            return
        self.submit(client, tenant, req)

    def cancel_local(self, client: bytes, tenant_name: str, rid: str) -> None:
        tenant = self._flight.table.tenants.get(tenant_name)
        if tenant is not None and self._transport.is_local(client):
            self.cancel(tenant, client, rid)

    def close_local(self, client: bytes, why: str) -> None:
        if self._transport.is_local(client):
            self._control.drop_client(client, why)

    # ------------------------------------------------------------------ cancel

    def cancel(self, tenant: Tenant, client: bytes, rid: str) -> None:
        """A cancel; one naming no request is refused, unless the connection is not reading."""
        try:
            self._control.cancel(tenant.name, client, rid)
        except ProtocolError as exc:
            if self._transport.outbox_full(client):
                self._counters.messages_dropped += 1  # not reading: an answer would only grow its outbox
            else:
                self._refuse(client, exc)

    # ------------------------------------------------------------------ submit

    def submit(self, client: bytes, tenant: Tenant, req: Submit) -> None:
        """Track a new request, or end it at once when a limit refuses it; then admit it (now, with
        its token ids given) or tokenize it first (in a task)."""
        flight = self._flight
        requests = flight.requests
        if (tenant.name, client, req.id) in requests:
            self._refuse(
                client,
                ProtocolError(
                    ErrorCode.DUPLICATE_REQUEST_ID,
                    f"request id {req.id!r} is already in flight on this connection; pick a new id",
                    req.id,
                ),
            )
            return
        t = Tracked(
            client=client,
            tenant=tenant.name,
            rid=req.id,
            seq=requests.next_seq(),
            received_at=time.monotonic(),
            req=req,
        )
        requests.add(t)
        if flight.closing:
            flight.finish_here(t, FinishReason.ERROR, SHUTTING_DOWN)
            return
        busy = self._busy(client, tenant)
        if busy is not None:
            flight.finish_here(t, FinishReason.ERROR, (ErrorCode.BUSY, busy[0]), busy[1])
            return
        if flight.info is None:
            self._early.append(t)  # the model is loading: counted against the limits, admitted when ready
            return
        self._start(t)

    def _start(self, t: Tracked) -> None:
        if t.req.tokens is not None and t.req.tools is None:
            self._admit(t, list(t.req.tokens))  # nothing to tokenize: admit in order, at once
        else:
            self.tasks.start_soon(self._tokenize_then_admit, t)

    def on_ready(self) -> None:
        """The model is loaded: the requests that came meanwhile go on, in arrival order."""
        early, self._early = self._early, []
        for t in early:
            if self._flight.requests.holds(t):
                self._start(t)

    def _busy(self, client: bytes, tenant: Tenant) -> tuple[str, float] | None:
        """Why a request just tracked for ``client`` must wait for others to end, and the retry hint;
        ``None`` when no limit refuses it."""
        requests = self._flight.requests
        mine = requests.client_count(client)  # the new request included
        waiting, total = requests.waiting(tenant.name) - 1, requests.waiting() - 1  # others, not this one
        if mine > self.settings.max_inflight_per_client:
            return (
                f"busy: this connection has {mine - 1} requests in flight "
                f"(limit {self.settings.max_inflight_per_client}); wait for some to end",
                1.0,
            )
        retry = min(30.0, max(0.1, 0.05 * (total + 1)))
        if waiting >= tenant.max_queued:
            return (
                f"busy: tenant {tenant.name!r} has {waiting} requests waiting (limit {tenant.max_queued}); retry later",
                retry,
            )
        if total >= self.settings.max_queued and not self._make_room(tenant.name, waiting):
            return f"busy: {total} requests are waiting (limit {self.settings.max_queued}); retry later", retry
        return None

    def _make_room(self, tenant: str, waiting: int) -> bool:
        """The queue is full: a tenant with fewer requests waiting than another takes the place of
        that tenant's newest waiting request (which ends ``busy``), so no tenant can fill the queue
        and keep the others out. ``False`` when no tenant holds more than this one."""
        requests = self._flight.requests
        most, largest = None, waiting + 1
        for name in requests.waiting_tenants():
            n = requests.waiting(name) - (1 if name == tenant else 0)
            if name != tenant and n > largest:
                most, largest = name, n
        if most is None:
            return False
        victim = max(
            (t for t in requests if t.tenant == most and not t.in_engine),
            key=lambda t: (-t.req.priority, t.seq),
        )
        retry = min(30.0, max(0.1, 0.05 * (requests.waiting() + 1)))
        why = f"busy: the queue is full and tenant {most!r} holds the most of it ({largest} waiting); retry later"
        self._flight.finish_here(victim, FinishReason.ERROR, (ErrorCode.BUSY, why), retry)
        return True

    async def _tokenize_then_admit(self, t: Tracked) -> None:
        flight = self._flight
        assert flight.info is not None
        try:
            if t.req.tools is None:
                ids = await self._tokenizer.run(t.tenant, prompt_ids, t.req, flight.tokenizer, flight.info)
            else:
                t.req, ids, opens = await self._tokenizer.run(
                    t.tenant, tool_calls.prepare, t.req, flight.tokenizer, flight.info
                )
                if t.req.tools is not None and t.req.tools.parse:
                    t.calls = Answer(flight.tokenizer, t.req.tools, opens)
        except ProtocolError as exc:
            flight.finish_here(t, FinishReason.ERROR, (exc.code, exc.message))
            return
        except Exception as exc:
            flight.finish_here(t, FinishReason.ERROR, (ErrorCode.BAD_FIELD, f"could not tokenize the prompt: {exc}"))
            return
        if not flight.requests.holds(t):
            return  # ended meanwhile (shutdown)
        self._admit(t, ids)

    def _admit(self, t: Tracked, ids: list[int]) -> None:
        flight = self._flight
        assert flight.info is not None
        if t.cancel_requested:
            flight.finish_here(t, FinishReason.CANCELLED, None)
            return
        if flight.closing:
            flight.finish_here(t, FinishReason.ERROR, SHUTTING_DOWN)
            return
        tenant = flight.table.tenants.get(t.tenant)
        if tenant is None:
            flight.finish_here(t, FinishReason.ERROR, (ErrorCode.UNAUTHORIZED, "the tenant was removed"))
            return
        try:
            admitted = admit(t.req, ids, flight.info, self.settings.limits, tenant)
        except ProtocolError as exc:
            flight.finish_here(t, FinishReason.ERROR, (exc.code, exc.message))
            return
        t.prompt_tokens = len(admitted.prompt)
        t.detok = flight.tokenizer.detokenizer
        t.stops = StopStrings(t.req.stop) if t.req.stop else None
        t.job = job_for(t, admitted, tenant)
        budget = request_kv_budget(self.settings)
        if budget and flight.kv_need(t) > budget:
            need_mb, budget_mb = flight.kv_need(t) / 2**20, budget / 2**20
            kept = self.settings.prefix_cache_bytes / 2**20
            flight.finish_here(
                t,
                FinishReason.ERROR,
                (
                    ErrorCode.KV_BUDGET,
                    f"this request needs {need_mb:.1f} MiB of KV cache (prompt + max_tokens) but the daemon's whole "
                    f"budget for requests is {budget_mb:.1f} MiB"
                    + (f" ({kept:.1f} MiB more are kept for the prefix cache)" if kept else "")
                    + "; lower max_tokens or shorten the prompt",
                ),
            )
            return
        flight.queue(tenant, t)


def job_for(t: Tracked, admitted: Admitted, tenant: Tenant) -> Job:
    """The engine's job for an admitted request: the one conversion from the wire's sampling
    options to the engine's, and the prefix-cache salt that keeps tenants' cached prompts apart
    unless the tenant shares them."""
    wire = t.req.sampling
    return Job(
        seq=t.seq,
        prompt=admitted.prompt,
        max_tokens=admitted.max_tokens,
        sampling=SamplingParams(
            temperature=wire.temperature,
            top_p=wire.top_p,
            top_k=wire.top_k,
            min_p=wire.min_p,
            seed=wire.seed,
            presence_penalty=wire.presence_penalty,
            frequency_penalty=wire.frequency_penalty,
            repetition_penalty=wire.repetition_penalty,
            logit_bias=wire.logit_bias,
            min_tokens=wire.min_tokens,
            ignore_eos=wire.ignore_eos,
            grammar=grammar_of(t.req),
        ),
        stop_token_ids=tuple(t.req.stop_token_ids),
        logprobs=t.req.logprobs,
        received_at=t.received_at,
        cache_salt=salt_for(tenant.name, tenant.share_prefix_cache),
        top_logprobs=t.req.top_logprobs,
        # A group's name is the sender's own: another connection's group of the same name is another.
        group=None if t.req.group is None else f"{t.client.hex()}/{t.req.group[0]}",
        group_size=0 if t.req.group is None else t.req.group[1],
    )
