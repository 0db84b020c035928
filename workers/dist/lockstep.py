"""Rank 0's decisions on every rank: ``Broadcaster`` (a msgpack-able value from rank 0) and
``Lockstep`` (each engine iteration's ``Plan``, in order). See ``workers.dist`` for why.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import msgpack

from workers.api import Command, from_wire, to_wire
from workers.api.wire import WireError
from workers.dist.world import DistributedError, World, array_bytes, uint8_array

#: Bytes of the first collective of every broadcast; a payload that fits (a decode step's plan does)
#: costs one collective, a larger one (a batch of long prompts) a second one for the rest.
INLINE_BYTES = 1024
#: Seconds an idle leader waits for commands before its next plan, and a follower sleeps after an idle
#: plan: a new request waits at most this long for the followers, who do not spin meanwhile.
IDLE_WAIT_S = 0.02

_MAGIC = 0xB5
_HEADER = struct.Struct("<BxxxII")  # magic, payload length, broadcast ordinal


class Broadcaster:
    """Rank 0's msgpack-able value on every rank, as sums of ``uint8`` arrays to which the other
    ranks add zeros (mlx has no broadcast; nothing is pickled, so a peer cannot run code here).

    Every broadcast carries an ordinal: a follower that receives one out of turn, or a sum two ranks
    both wrote into, fails loudly instead of applying garbage."""

    def __init__(self, world: World, inline_bytes: int = INLINE_BYTES) -> None:
        if inline_bytes <= _HEADER.size:
            raise ValueError(f"inline_bytes must exceed the {_HEADER.size}-byte header")
        self.world = world
        self.inline_bytes = inline_bytes
        self.count = 0

    def __call__(self, value: Any = None) -> Any:
        """Rank 0 passes ``value`` and gets it back; the others pass nothing and get rank 0's."""
        ordinal, self.count = self.count, self.count + 1
        if not self.world.distributed:
            return value
        room = self.inline_bytes - _HEADER.size
        if self.world.leader:
            payload = msgpack.packb(value, use_bin_type=True)
            first = bytearray(self.inline_bytes)
            _HEADER.pack_into(first, 0, _MAGIC, len(payload), ordinal)
            first[_HEADER.size : _HEADER.size + min(room, len(payload))] = payload[:room]
            self.world.all_sum(uint8_array(bytes(first)))
            if len(payload) > room:
                self.world.all_sum(uint8_array(payload[room:]))
            return value
        first_bytes = array_bytes(self.world.all_sum(mx.zeros((self.inline_bytes,), dtype=mx.uint8)))
        magic, length, got = _HEADER.unpack_from(first_bytes, 0)
        if magic != _MAGIC or got != ordinal:
            raise DistributedError(
                f"rank {self.world.rank}: broadcast {ordinal} arrived as {got} (marker {magic:#x}); the ranks diverged"
            )
        payload = first_bytes[_HEADER.size : _HEADER.size + min(room, length)]
        if length > room:
            payload += array_bytes(self.world.all_sum(mx.zeros((length - room,), dtype=mx.uint8)))
        try:
            return msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except ValueError as exc:  # msgpack's format errors are ValueErrors
            raise DistributedError(
                f"rank {self.world.rank}: broadcast {ordinal} is not msgpack ({exc}); the ranks diverged"
            ) from None


@dataclass
class Plan:
    """One engine iteration as rank 0 decided it; every rank applies it in the same order.

    ``commands`` are the front end's commands taken this iteration (submits, cancels, pauses,
    resumes), applied in order before anything else; they become plain maps only to cross to other
    ranks (``to_wire``), never on one rank. ``decisions`` are the
    iteration's clock- or entropy-driven choices, by name (whether it is a burst round, a batched
    step or a probe step, a seed drawn for an unseeded request). ``wait_s`` is how long rank 0 will
    wait for commands before its next plan: followers sleep that long instead of spinning inside
    the next collective. ``stop`` ends the followers' loop."""

    iteration: int
    commands: list[Command] = field(default_factory=list)
    decisions: dict[str, Any] = field(default_factory=dict)
    wait_s: float = 0.0
    stop: bool = False

    def to_wire(self) -> list[Any]:
        return [self.iteration, [to_wire(c) for c in self.commands], self.decisions, self.wait_s, self.stop]

    @classmethod
    def from_wire(cls, w: list[Any]) -> Plan:
        iteration, commands, decisions, wait_s, stop = w
        try:
            cmds = [from_wire("command", c) for c in commands]
        except WireError as exc:
            raise DistributedError(f"a plan carried {exc}") from None
        return cls(iteration, cmds, decisions, wait_s, stop)


class Lockstep:
    """Rank 0 publishes each iteration's ``Plan``; followers receive them in order.

    On one rank ``publish`` costs nothing and ``receive`` is never called, so the engine loop can
    use it unconditionally."""

    def __init__(self, world: World, inline_bytes: int = INLINE_BYTES) -> None:
        self.world = world
        self._broadcast = Broadcaster(world, inline_bytes)
        self.iteration = 0
        self._sleep_s = 0.0

    def publish(
        self,
        commands: list[Command] | None = None,
        decisions: dict[str, Any] | None = None,
        wait_s: float = 0.0,
        stop: bool = False,
    ) -> Plan:
        """Rank 0: send this iteration's plan to every follower and return it."""
        if not self.world.leader:
            raise DistributedError(f"rank {self.world.rank} may not publish plans: only rank 0 decides")
        plan = Plan(self.iteration, commands or [], decisions or {}, wait_s, stop)
        if self.world.distributed:  # alone, nothing is sent and nothing converted
            self._broadcast(plan.to_wire())
        self.iteration += 1
        return plan

    def receive(self) -> Plan:
        """A follower: the next plan (after sleeping the last plan's ``wait_s``)."""
        if self.world.leader:
            raise DistributedError("rank 0 publishes plans; it never receives them")
        if self._sleep_s > 0:
            time.sleep(self._sleep_s)
        plan = Plan.from_wire(self._broadcast())
        if plan.iteration != self.iteration:
            raise DistributedError(
                f"rank {self.world.rank}: plan {plan.iteration} arrived where {self.iteration} was due"
            )
        self.iteration += 1
        self._sleep_s = plan.wait_s
        return plan

    def follow(self, apply: Callable[[Plan], None]) -> int:
        """A follower's whole loop: apply every plan until rank 0 says stop; returns the plans applied."""
        applied = 0
        while True:
            plan = self.receive()
            if plan.stop:
                return applied
            apply(plan)
            applied += 1
