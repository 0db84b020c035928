"""The engine's part of the ``stats`` reply (``stats.engine``): its shape, defined once.

``EngineThread.snapshot`` produces it; the front end puts it in the reply unchanged
(``scheduler.stats_types.StatsReply``), and ``mlx-batchd stats``, ``top`` and the Prometheus
exposition read it. Before the model is loaded the part is an empty map (``EngineNotReady``);
``ready`` tells the two apart.

Fields typed with a ``StrEnum`` (``Level``) hold values equal to its members: msgpack carries a
``StrEnum`` as its plain string, so a reader on the far side of a socket (the front end of an engine
process, a client) holds that string, and the engine's pin ledger, pin cost and verdicts
put the string in already. Readers compare and format these fields, which is the same for both,
and never use enum attributes on them.

Only typing is imported at run time, so the client-side commands that read the reply (``stats``,
``top``) do not load MLX.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict, TypeGuard, cast, final

from workers.api.settings import Level, PinScope


class CountersSnapshot(TypedDict):
    """``workers.engine.sequences.EngineCounters``, monotonic from the end of warm-up."""

    submitted: int
    finished: int
    prompt_tokens: int
    generated_tokens: int
    decode_steps: int
    decode_seconds: float
    steps: int
    step_seconds: float
    step_cpu_seconds: float
    step_preemptions: int
    step_errors: int
    peak_batch_size: int
    prefill_steps: int
    finish_steps: int


class PinRow(TypedDict):
    """Forwards at one (level, purpose): ``purpose`` is who asked (``verify``, ``classic``,
    ``probe``, ``serving``)."""

    level: Level
    purpose: str
    forwards: int
    rows: int
    seconds: float


class PinsSnapshot(TypedDict):
    """The pin ledger (``workers.exact.pins.PinLedger``): forwards that asked for their level, forwards
    that inherited it from a process-wide pin, and the collateral ones (pinned without asking)."""

    pinned: list[PinRow]
    unrequested: list[PinRow]
    collateral_forwards: int
    collateral_seconds: float


@final
class VerdictRow(TypedDict):
    """A pairing's verdict: the level its verify runs at, or ``None`` when bursts are declined."""

    level: Level | None
    exact: bool
    reason: str
    probe_seconds: float
    #: Read from the verdict store rather than probed in this run.
    from_cache: bool


@final
class ProbingRow(TypedDict):
    """A pairing whose probe is still running, and the draw it is at."""

    status: Literal["probing"]
    at: str


class BurstSummary(TypedDict):
    """B = 1 speculative bursts (``workers.engine.spec.runner.BurstRunner``); ``drafter`` is ``None`` when
    bursts are off. ``declined`` counts bursts not run by reason; ``revoked`` holds the pairings an
    audit failed, with why."""

    drafter: str | None
    k: int
    active: bool
    bursts: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    interrupted: int
    declined: dict[str, int]
    audits: int
    audit_failures: int
    #: Rounds whose verify was built while the previous round ran (``workers.engine.spec.lookahead``).
    ahead_rounds: int
    #: Rounds whose drafts were computed with the verify in one evaluation (``draft_in_verify``).
    fused_rounds: int
    #: Wall seconds of all rounds, drafting to emitting.
    round_seconds: float
    revoked: dict[str, str]
    speedup_estimate: float | None
    classic_step_s: float | None
    round_s: float | None
    #: What the adaptive gate's estimate read when it last paused bursting (``Adaptive.last_pause``).
    last_pause: dict[str, float] | None
    #: Median round seconds with the next round built ahead (``on``) and without (``off``), as the
    #: gate last timed them (``Adaptive.build_ahead``); ``None`` where not timed.
    ahead_round_s: dict[str, float | None]


class PinCostRow(TypedDict):
    """One batched decode step at ``batch`` sequences, wide and pinned at ``level``
    (``workers.exact.pin_cost.PinCost``)."""

    level: Level
    batch: int
    wide_step_s: float
    pinned_step_s: float
    #: ``pinned_step_s / wide_step_s``.
    ratio: float


class PinTax(TypedDict, total=False):
    """What a process-wide pin would cost batched decode, as the probe measured it with the serving
    pairing's verdict (``workers.exact.pin_cost.summary``); empty without a verdict."""

    #: The level a process-wide pin would run at: the verdict's where it pins, else the first rung measured.
    level: Level
    #: Every rung and batch bucket measured.
    rows: list[PinCostRow]
    #: Batched decode seconds a process-wide pin would have added so far (0 under one).
    estimated_seconds_saved_by_scoping: float


class ReuseDraw(TypedDict):
    """One warm-vs-cold draw of the prefix cache's start-up check (``workers.engine.prefix_check.Draw``)."""

    prompt: int
    cached: int
    decoded: int
    trimmed: int
    past_window: bool
    differing_bytes: int
    total_bytes: int
    skipped: str | None


class ReuseVerdictRow(TypedDict):
    """Whether reusing cached KV equals a cold prefill (``workers.engine.prefix_check.ReuseVerdict``)."""

    exact: bool
    reason: str
    draws: list[ReuseDraw]
    seconds: float
    window_only: bool


class PrefixCacheSnapshot(TypedDict):
    """The prefix cache (``workers.engine.prefix_cache.PrefixCache``); only ``enabled`` while it is off."""

    enabled: bool
    serving: NotRequired[bool]
    max_bytes: NotRequired[int]
    bytes: NotRequired[int]
    entries: NotRequired[int]
    queries: NotRequired[int]
    hits: NotRequired[int]
    hit_tokens: NotRequired[int]
    lookup_tokens: NotRequired[int]
    stored: NotRequired[int]
    evictions: NotRequired[int]
    too_large: NotRequired[int]
    past_window: NotRequired[int]
    #: ``hit_tokens / lookup_tokens`` (0 before any lookup).
    hit_rate: NotRequired[float]
    allow_inexact: NotRequired[bool]
    verdict: NotRequired[ReuseVerdictRow | None]


class MemorySnapshot(TypedDict):
    """MLX's memory in bytes: in arrays, freed buffers kept for reuse, and the peak."""

    active_bytes: int
    cache_bytes: int
    peak_bytes: int


class AdmissionSnapshot(TypedDict):
    """Admission waves (``workers.engine.arrivals``): the hold windows (busy, idle engine), arrivals waiting
    now, arrivals held past the iteration that took them since start, and the seconds an idle engine
    held arrivals before starting them."""

    window_ms: float
    idle_window_ms: float
    held: int
    delayed: int
    idle_hold_seconds: float


class LoopSnapshot(TypedDict):
    """The engine loop's own account (``workers.engine.loop``): its iterations since start and the seconds
    the engine thread spent handing events to the front end (the part of the loop's time that grows
    with the steps; the rest of an iteration is microseconds)."""

    iterations: int
    emit_seconds: float
    #: The CPUs the engine thread may run on (``None`` where the OS cannot say): the daemon's CPU
    #: split (``scheduler.affinity``) as the OS applied it.
    cpus: list[int] | None


class DistributedSnapshot(TypedDict):
    """Which ranks serve the model (``workers.dist``): ``world_size`` 1, ``backend``
    ``single`` and ``mode`` ``none`` for one process; else the ``mx.distributed`` backend (ring,
    nccl, jaccl, mpi) and how the model is split (``tensor`` or ``pipeline``). ``rank`` is the one
    that answered: always 0, the rank with the front end."""

    world_size: int
    rank: int
    backend: str
    mode: Literal["tensor", "pipeline", "none"]


class StartUpRow(TypedDict):
    """Start-up work the engine runs between its steps after ``Ready`` (``workers.engine.background``:
    kernel plans, the prefix cache's check, the probe's start): ``pending`` behind other work,
    ``running`` (``at``: what its last unit did), ``done`` or ``failed`` (``at``: why); ``units`` run,
    ``seconds`` from its first unit to its end."""

    status: Literal["pending", "running", "done", "failed"]
    at: str
    units: int
    seconds: float


@final
class EngineSnapshot(CountersSnapshot):
    """The engine's counters and gauges, once the model is loaded."""

    active_sequences: int
    paused: int
    batch_size: int
    pin_scope: PinScope
    pins: PinsSnapshot
    #: By pairing name: its verdict, or where its probe is.
    verdicts: dict[str, VerdictRow | ProbingRow]
    bursts: BurstSummary
    pin_tax: PinTax
    prefix_cache: PrefixCacheSnapshot
    memory: MemorySnapshot
    admission: AdmissionSnapshot
    loop: LoopSnapshot
    distributed: DistributedSnapshot
    #: ``fastpath.plans_summary`` of this engine's calibration (empty where the backend has none).
    kernel_plans: dict[str, str]
    #: How many of the model's decoder layers run as compiled halves in decode steps (``compiled_layers``).
    compiled_layers: int
    #: Bytes of the dequantized shadow of the quantized projections (``serve --dense-shadow``; 0 when off).
    dense_shadow_bytes: int
    #: Start-up work by name (``kernel plans``, ``prefix check``, ``probe``), pending or ended.
    start_up: dict[str, StartUpRow]
    #: Seconds by phase before ``Ready`` (set-up, weights, widths, engine, warm-up, ...).
    ready_phases: dict[str, float]


@final
class EngineNotReady(TypedDict):
    """The engine's part before the model is loaded: an empty map."""


EnginePart = EngineSnapshot | EngineNotReady


def ready(part: EnginePart) -> TypeGuard[EngineSnapshot]:
    """Whether the engine's part is a loaded engine's (not the empty map of one still loading)."""
    return bool(part)


def read_engine(part: Mapping[str, Any]) -> EnginePart:
    """The engine's part as an engine handle passes it on: a plain map (msgpack from an engine
    process). Nothing is checked: ``EngineThread.snapshot`` built it to this shape."""
    return cast(EnginePart, part)
