"""Admission waves: requests that arrive while a batch decodes join it together.

Every group of prompts that joins a decoding batch costs mlx-lm's ``BatchGenerator`` a prefill
forward, a split of its prompt batch and a merge of every layer's cache into the decode batch; the
group then tends to finish together, and every step in which sequences finish filters every
layer's cache. Requests that reach the engine over a few milliseconds (many clients starting at
once through the front end) would otherwise join one or two per engine iteration, multiplying those
costs against the same requests submitted at once.

So while the engine has work, arrivals are held for at most ``window_s`` (from the first held one),
and released as soon as a full prefill wave (``wave`` prompts) waits; never past a command that must
keep its order behind them (a cancel, pause, resume or shutdown releases every held arrival first).
The trade is TGI's ``max_waiting_tokens``: a bounded wait before the first token of a request that
arrives mid-batch, for fewer interruptions of everyone's decode. ``window_s = 0`` turns it off.

An idle engine holds arrivals until none has come for ``idle_window_s`` (0: not at all), and never
past ``IDLE_HOLD_MAX`` windows (at least ``IDLE_HOLD_S``) from the first held one. Clients that start
together reach an idle engine some milliseconds apart, and without the hold the first would start a
prefill wave of its own while the rest queue for the next. The window is a quiet gap that each
arrival restarts (a window counted from the first arrival still split large groups); its cost is one
window on a lone request's first token, and at most the cap on any. Threads that each send one request
can still spread past the cap; a client sending from one event loop (``generate_many``) does not.

A client that knows its group says so (``Submit.group``: a name and a size; ``generate_many`` does): held
arrivals go in as soon as every one of them belongs to a declared group that has all its members, so a
lone declared request pays no window and a declared group none after its last member. Declarations only
release early, never hold longer: members a front end keeps back (tenant shares, queues), or another
client's undeclared arrival, leave the window as above; so no sender's declaration makes anyone wait
longer, and a group's name is scoped to its sender's connection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.api import Command, SubmitJob

#: The longest an idle engine holds an arrival, in idle windows (a steady trickle of arrivals less
#: than a window apart would otherwise hold the first of them indefinitely), and at least this many
#: seconds whatever the window.
IDLE_HOLD_MAX = 5
IDLE_HOLD_S = 0.05


@dataclass
class AdmissionWaves:
    #: Prompts the generator prefills together (``EngineSettings.prefill_batch``).
    wave: int
    #: The longest an arrival waits for others while the engine has work (seconds).
    window_s: float
    #: The same while the engine is idle (seconds; 0: an idle engine takes every arrival at once).
    idle_window_s: float = 0.0
    held: list[SubmitJob] = field(default_factory=list)
    #: When the oldest held arrival was taken from the inbox.
    since: float | None = None
    #: When the newest held arrival was taken from the inbox.
    last: float | None = None
    #: Arrivals held past the iteration that took them (for the stats).
    delayed: int = 0
    #: Seconds an idle engine spent holding arrivals before it started them (a declared group
    #: gathering, the idle window): time the engine had work in hand and ran none of it.
    idle_hold_seconds: float = 0.0
    #: When the current hold began, if it began on an idle engine.
    idle_since: float | None = None

    def take(self, cmds: list[Command], busy: bool, now: float) -> list[Command]:
        """The commands to apply this iteration, in arrival order; held submits stay for a later
        one. ``busy``: the engine has sequences in flight (``window_s`` applies; else ``idle_window_s``)."""
        window = self.window_s if busy else self.idle_window_s
        if window <= 0 or any(not isinstance(c, SubmitJob) for c in cmds):
            return self._release(cmds, now)
        fresh = [c for c in cmds if isinstance(c, SubmitJob)]
        if fresh:
            if self.since is None:
                self.since = now
                self.idle_since = None if busy else now
            self.last = now
        self.held += fresh
        # Only an arrival can make the held groups whole: iterations with none skip the count.
        whole = bool(fresh) and self._groups_whole()
        if len(self.held) >= self.wave or whole or (self.since is not None and now >= self._due(busy)):
            return self._release([], now)
        self.delayed += len(fresh)
        return []

    def _groups_whole(self) -> bool:
        """Every held arrival came in a declared group and every such group has all its members here:
        nothing more is coming that the hold waits for (an undeclared arrival keeps the window)."""
        have: dict[str, int] = {}
        size: dict[str, int] = {}
        for cmd in self.held:
            group = cmd.job.group
            if group is None:
                return False
            have[group] = have.get(group, 0) + 1
            size[group] = cmd.job.group_size
        return bool(have) and all(have[g] >= size[g] for g in have)

    def _due(self, busy: bool) -> float:
        """When the held arrivals go in: ``window_s`` after the first while the engine has work; while
        it is idle, ``idle_window_s`` after the latest, at most the cap after the first."""
        assert self.since is not None and self.last is not None
        if busy:
            return self.since + self.window_s
        cap = max(IDLE_HOLD_S, IDLE_HOLD_MAX * self.idle_window_s)
        return min(self.last + self.idle_window_s, self.since + cap)

    def wait_s(self, now: float) -> float | None:
        """How long an idle engine's loop may wait for more arrivals before the held ones are due
        (``None``: nothing is held)."""
        if self.since is None:
            return None
        return max(0.0, self._due(busy=False) - now)

    def _release(self, cmds: list[Command], now: float) -> list[Command]:
        if self.idle_since is not None:
            self.idle_hold_seconds += now - self.idle_since
        out: list[Command] = [*self.held, *cmds]
        self.held, self.since, self.last, self.idle_since = [], None, None, None
        return out
