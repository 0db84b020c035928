"""The engine's settings and the plain values the front end reads without loading the engine: kernel
levels, the probe policy, burst settings, the prefill budget, the prefix cache's salts.

No MLX import: the daemon's front end and the CLI build these, and the engine process gets them over
its pipe (``workers.api.wire``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

#: Rows one call of the project's row kernels takes (``workers.kernels``' ``qmv_launch``); a longer
#: verify block runs in calls of this many.
MAX_ROWS = 8


class Level(StrEnum):
    """How a forward's kernels run (``workers.kernels``): the rungs of the probe's ladder."""

    WIDE = "wide"
    NARROW = "narrow"
    PER_QUERY = "per-query"
    PADDED = "padded"
    ROWWISE = "rowwise"
    MIRRORED = "mirrored"
    PER_QUERY_1 = "per-query-1"

    @property
    def per_query(self) -> bool:
        """Whether attention runs one query at a time through the cache's update path."""
        return self in (Level.PER_QUERY, Level.PADDED, Level.ROWWISE, Level.MIRRORED, Level.PER_QUERY_1)

    @property
    def pins_chain(self) -> bool:
        """Whether classic decode of the lone sequence must run at this level too for a verify at
        it to equal classic decode (``padded``: one row and five rows both become ``PAD_ROWS``;
        ``rowwise``: both go through the project's kernel)."""
        return self in (Level.PADDED, Level.ROWWISE)

    @property
    def calibrated(self) -> bool:
        """Whether projections run in chunks of a per-module width (calibrated by the probe)."""
        return self in (Level.NARROW, Level.PER_QUERY)


@dataclass(frozen=True)
class ProbePolicy:
    """What the operator accepts besides an exact rung: any level marked inexact, one pinned level,
    classic decode's own run-to-run variation; and whether a divergence is localized."""

    allow_inexact: bool = False
    pinned_level: Level | None = None
    accept_classic_variation: bool = False
    localize: bool = False


#: Drafted tokens a round when the operator names none, for drafters other than an MTP head.
DEFAULT_K = 4


#: An MTP head's drafted tokens a round when the operator names none: the most whose verify block
#: (K + 1 rows) is one call of the project's row kernels (``MAX_ROWS``). Its drafts are chained head
#: steps computed on the device in the verify's evaluation, so a draft more costs a small share of a
#: round while its acceptance stays high; past ``MAX_ROWS`` the block takes two calls and the gain is
#: gone (measured K = 4, 6, 7 and 8 on the demo pair: 7 paid best). Other drafters keep ``DEFAULT_K``:
#: prompt lookup was measured at 4, and a bigger verify block costs a large target more.
MTP_K = MAX_ROWS - 1


def default_k(mtp: bool) -> int:
    """Drafted tokens a round for a pairing whose drafter is an MTP head (``mtp``) or another."""
    return MTP_K if mtp else DEFAULT_K


@dataclass
class BurstSettings:
    #: Drafted tokens a round (the verify block is K + 1 tokens); the CLI's default is ``default_k``.
    k: int = DEFAULT_K
    #: Fraction of rounds whose first position is re-computed with a single-token forward.
    audit_fraction: float = 0.02
    #: Classic B = 1 steps timed before the first burst of a pairing, and again after a pause.
    profile_steps: int = 3
    #: Rounds measured before the adaptive policy may stop bursting.
    min_rounds: int = 16
    #: How many of the latest rounds (and classic steps) the policy's estimate reads (at least
    #: ``min_rounds``): medians over this many ride out a stretch of slow rounds or low acceptance.
    window_rounds: int = 64
    #: Seconds bursting stays off after the measured speedup fell below 1: ``reprofile_first_s`` the
    #: first time, doubling with each pause that follows without a window that paid in between, at
    #: most ``reprofile_after_s``. Why not the longest at once: a window of rounds that reads just under
    #: 1 can pause bursts that pay, and a long pause of classic decode then costs more than the bursts
    #: had won; a pairing that never pays is still retried less and less often.
    reprofile_first_s: float = 1.0
    reprofile_after_s: float = 30.0
    seed: int = 0
    #: Build the next round's verify while this one runs, where the drafter can guess it
    #: (``workers.engine.spec.lookahead``).
    lookahead: bool = True
    #: With ``lookahead``: time rounds built each way and keep the faster (``Adaptive.build_ahead``);
    #: off: build ahead on every round that can.
    lookahead_choice: bool = True
    #: A drafter that drafts on the device (the MTP head) has its proposal built into the verify's
    #: graph, not evaluated first: one evaluation a round, and the device drafts while the host builds
    #: the verify (``BurstRunner.round``). Off: the proposal is evaluated, then the verify built on it.
    draft_in_verify: bool = True


#: Prompt tokens one prefill step may carry across a wave (``prefill_tokens``): 64 prompts of up to
#: 64 tokens, or 2 of a full 2,048-token chunk.
PREFILL_TOKENS = 4096


#: Whether cuDNN attention is on where neither the environment nor ``cudnn_attention`` says.
CUDNN_ATTENTION_DEFAULT = False


@dataclass
class EngineSettings:
    max_batch: int = 32
    #: Most prompts one prefill wave takes (``None``: ``max_batch``); ``prefill_tokens`` sizes it.
    prefill_batch: int | None = None
    prefill_step: int = 2048
    #: Prompt tokens one prefill step carries across its wave (``workers.engine.prefill_wave``).
    prefill_tokens: int = PREFILL_TOKENS
    #: Seconds a prefill step is sized to stay within at the measured speed (``workers.engine.prefill_pace``);
    #: 0: no time bound. The daemon sets it from ``engine_timeout`` (``scheduler.engine_watchdog``).
    step_target_s: float = 0.0
    #: While the engine has work, an arrival waits at most this long for others so that they join
    #: the batch in one prefill wave (``workers.engine.arrivals``); 0 admits each on the next iteration.
    admit_window_s: float = 0.02
    #: The same for arrivals that find the engine idle, so that clients starting together form one
    #: wave (``workers.engine.arrivals``); 0 admits the first at once. A short window keeps clients that
    #: start together in one wave (measured to pay on a GPU) at the cost of that window on a lone
    #: request's time to first token.
    admit_idle_window_s: float = 0.01
    #: MLX CUDA's cuDNN attention (``workers.kernels.backend.configure_attention``): off unless asked for or
    #: set in the environment.
    cudnn_attention: bool = CUDNN_ATTENTION_DEFAULT
    #: Probe the pairing at start-up for this many drafted tokens (verify width K + 1).
    probe_k: int | None = None
    drafter: str = "none"
    probe_policy: ProbePolicy = field(default_factory=ProbePolicy)
    #: ``--draft``: a draft model directory, ``demo`` or ``prompt-lookup``; ``--mtp``: an MTP head.
    draft: str | None = None
    mtp: str | None = None
    bursts: BurstSettings = field(default_factory=BurstSettings)
    #: Bytes of freed buffers MLX may keep for reuse (``mx.set_cache_limit``); ``None``: a quarter of
    #: MLX's memory limit (``buffer_cache_limit``). Whatever the limit, the cache is emptied whenever
    #: the engine goes idle.
    mlx_cache_limit_bytes: int | None = None
    #: Bytes of KV the prefix cache may keep (LRU eviction); 0 (the default) turns it off and skips its
    #: start-up check. It serves when ``warm_vs_cold`` finds reuse exact, or under ``allow_inexact``.
    prefix_cache_bytes: int = 0
    #: Across ranks: seconds one engine iteration may take before this rank presumes a peer gone and
    #: exits (mlx's ring can leave a collective waiting for good when its peer dies mid-transfer).
    rank_timeout_s: float = 60.0
    #: ``--dense-shadow``: ``off``, ``auto`` or ``on`` (``workers.kernels.dense_shadow``): a dequantized
    #: copy of the quantized projections' weights, which calibration may route large batches through.
    dense_shadow: str = "off"
    #: The front end's KV budget (``--kv-budget-mb``; 0: none), which ``dense_shadow`` ``auto`` leaves free.
    kv_budget_bytes: int = 0

    @property
    def may_pin(self) -> bool:
        """Whether a forward of this engine may run above ``wide`` (a drafter's verify, the probe): only
        then does the load measure the projections' row-exact widths (``load(widths=...)``)."""
        return self.draft is not None or self.mtp is not None or self.probe_k is not None


#: The salt of tenants marked shareable; per-tenant salts carry a prefix, so no tenant name equals it.
SHARED_SALT = "shared"


def salt_for(tenant: str, shareable: bool) -> str:
    """The cache salt the front end gives a tenant's jobs: the shared salt, or one only it has."""
    return SHARED_SALT if shareable else f"tenant:{tenant}"


PinScope = Literal["scoped", "process"]
