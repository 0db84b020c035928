"""One prefill for a request's ``n`` sequences: the first prefills, its siblings take its KV.

A request's ``n`` sequences (``protocol.expand_n``) arrive as one declared group with one prompt.
Admitted together, each would prefill the whole prompt in the same wave. Instead the first one (the
leader) prefills alone; the others (followers) wait outside the batch until it has its first token,
its prompt's KV then goes to the prefix cache, and each follower enters the batch through the prefix
cache's ordinary lookup, which hands it a private copy of that KV and feeds only the prompt's last
token. So sharing is exactly as exact as the prefix cache itself: it happens only while the cache
serves (its start-up check found reuse exact, or the operator allowed inexact reuse), only under a
tenant's salt, and only for prompts the cache would take (``MIN_HIT_TOKENS`` and up); otherwise the
followers are placed at once and prefill as they always did.

A follower whose leader ends, is cancelled or is paused before its first token is placed at the
next step (it prefills whatever the cache does not give it).
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.engine.prefix_cache import MIN_HIT_TOKENS
from workers.engine.sequences import Sequence


class SharedPrefill:
    """The followers waiting for their leader's prefill, by leader."""

    def __init__(self) -> None:
        self._followers: dict[int, tuple[Sequence, list[Sequence]]] = {}  # by the leader's caller seq

    def leader_for(self, s: Sequence, others: Iterable[Sequence]) -> Sequence | None:
        """The sequence ``s`` should wait for: one of its group with its prompt and salt that has not
        produced a token yet (and is not itself waiting), or ``None``."""
        job = s.job
        if job.group is None or job.cache_salt is None or len(job.prompt) < MIN_HIT_TOKENS:
            return None
        waiting = {id(f) for _, fs in self._followers.values() for f in fs}
        for o in others:
            if (
                o is not s
                and o.job.group == job.group
                and o.job.cache_salt == job.cache_salt
                and o.job.prompt == job.prompt
                and o.first_token is None
                and o.parked is None
                and not o.paused
                and id(o) not in waiting
            ):
                return o
        return None

    def hold(self, leader: Sequence, s: Sequence) -> None:
        self._followers.setdefault(leader.job.seq, (leader, []))[1].append(s)

    def holds(self, s: Sequence) -> bool:
        return any(s is f for _, fs in self._followers.values() for f in fs)

    def drop(self, s: Sequence) -> None:
        """Forget a waiting follower (cancelled before it entered the batch)."""
        for key, (leader, fs) in list(self._followers.items()):
            kept = [f for f in fs if f is not s]
            if kept:
                self._followers[key] = (leader, kept)
            else:
                del self._followers[key]

    def ready(self, admitted: Iterable[int]) -> list[tuple[Sequence, list[Sequence]]]:
        """Leaders whose followers may go now (first token out, or ended, parked or paused), with
        those followers; they are forgotten here. ``admitted``: the caller seqs still in the engine."""
        alive = set(admitted)
        out = []
        for key, (leader, fs) in list(self._followers.items()):
            if leader.first_token is not None or leader.job.seq not in alive or leader.paused or leader.parked:
                del self._followers[key]
                out.append((leader, fs))
        return out

    def __len__(self) -> int:
        return sum(len(fs) for _, fs in self._followers.values())
