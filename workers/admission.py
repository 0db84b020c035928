"""Admission waves: requests that arrive while a batch decodes join it together.

Every group of prompts that joins a decoding batch costs mlx-lm's ``BatchGenerator`` a prefill
forward, a split of its prompt batch and a merge of every layer's cache into the decode batch; the
group then tends to finish together, and every step in which sequences finish filters every
layer's cache. Requests that reach the engine over a few milliseconds (64 clients starting at once
through the front end) would otherwise join one or two per engine iteration. On the H200 8B synth
at B = 64 that is what the daemon's engine did against the same 64 requests submitted at once: about
3x the cache filters, twice the prefill time, 56-70 ms per decode step against 39-47
(docs/benchmarks.md, "Where the daemon's engine loses step time").

So while the engine has work, arrivals are held for at most ``window_s`` (from the first held one),
and released as soon as a full prefill wave (``wave`` prompts) waits; never while the engine is
idle, and never past a command that must keep its order behind them (a cancel, pause, resume or
shutdown releases every held arrival first). The trade is TGI's ``max_waiting_tokens``: a bounded
wait before the first token of a request that arrives mid-batch, for fewer interruptions of
everyone's decode. ``window_s = 0`` turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.commands import Command, Submit


@dataclass
class AdmissionWaves:
    #: Prompts the generator prefills together (``EngineSettings.prefill_batch``).
    wave: int
    #: The longest an arrival waits for others while the engine has work (seconds).
    window_s: float
    held: list[Submit] = field(default_factory=list)
    #: When the oldest held arrival was taken from the inbox.
    since: float | None = None
    #: Arrivals held past the iteration that took them (for the stats).
    delayed: int = 0

    def take(self, cmds: list[Command], busy: bool, now: float) -> list[Command]:
        """The commands to apply this iteration, in arrival order; held submits stay for a later
        one. ``busy``: the engine has sequences in flight (holding an arrival for an idle engine
        would only delay it)."""
        if self.window_s <= 0 or not busy or any(not isinstance(c, Submit) for c in cmds):
            return self._release(cmds)
        fresh = [c for c in cmds if isinstance(c, Submit)]
        if fresh and self.since is None:
            self.since = now
        self.held += fresh
        if len(self.held) >= self.wave or (self.since is not None and now - self.since >= self.window_s):
            return self._release([])
        self.delayed += len(fresh)
        return []

    def _release(self, cmds: list[Command]) -> list[Command]:
        out: list[Command] = [*self.held, *cmds]
        self.held, self.since = [], None
        return out
