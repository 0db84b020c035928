"""An engine stepped to the end, with what each sequence received: the tests that compare runs
token for token (and logprob for logprob) read it here."""

from __future__ import annotations

from tests.helpers.top_logprobs import Top
from workers.api import Event, Finished, Job, Tokens
from workers.engine.engine import Engine


class Out:
    """What one sequence received: tokens, logprobs, top logprobs, modes, and how it ended."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.lps: list[float] | None = None
        self.tops: list[Top] | None = None
        self.modes: set[str] = set()
        self.end = ""

    def triple(self) -> tuple[list[int], list[float] | None, list[Top] | None]:
        return self.tokens, self.lps, self.tops

    def exact(self) -> tuple[list[int], list[str], list[list[tuple[int, str]]]]:
        """``triple`` with every float as its exact hex spelling: equal means equal to the bit."""
        lps = [lp.hex() for lp in self.lps or []]
        return self.tokens, lps, [[(t, lp.hex()) for t, lp in top] for top in self.tops or []]


def collect(events: list[Event], out: dict[int, Out]) -> None:
    for e in events:
        if isinstance(e, Tokens):
            o = out.setdefault(e.seq, Out())
            assert o.end == "", "tokens after the end"
            o.tokens += e.tokens
            o.modes.add(e.mode)
            if e.logprobs is not None:
                o.lps = (o.lps or []) + e.logprobs
            if e.top_logprobs is not None:
                assert len(e.top_logprobs) == len(e.tokens)
                o.tops = (o.tops or []) + e.top_logprobs
        elif isinstance(e, Finished):
            out.setdefault(e.seq, Out()).end = e.reason


def run(engine: Engine, jobs: list[Job], arrivals: dict[int, list[Job]] | None = None) -> dict[int, Out]:
    """Submit ``jobs`` and step to the end; ``arrivals[i]`` are submitted before step ``i``."""
    out: dict[int, Out] = {}
    for j in jobs:
        engine.submit(j)
    arrivals = dict(arrivals or {})
    step = 0
    while engine.has_work or arrivals:
        for j in arrivals.pop(step, []):
            engine.submit(j)
        collect(engine.step(), out)
        step += 1
    return out
