"""The engine's settings and its start-up: before ``Ready`` the engine, its warm-up, the prefix cache
and the drafter; after it, between steps (``workers.engine.background``), the kernel plans and the
prefix cache's check where their results are not stored yet, then the probe.

Across ranks every rank runs the same start-up: ``check_same_settings`` stops them all when their
options differ, and rank 0's verdict store answers for every rank (``RankZeroStore``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Generator
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from workers.api import EngineSettings, Job
from workers.dist import Broadcaster, DistributedError, World, check_same
from workers.engine.engine import Engine
from workers.engine.ready_phases import PhaseClock
from workers.exact import ProbeSetup, Verdict, VerdictStore, block_lengths, probe_setup, sliding_window
from workers.models import LoadedModel

if TYPE_CHECKING:
    from workers.engine.prefix_check import ReuseVerdict

#: MLX's buffer cache may hold this share of MLX's memory limit unless told otherwise.
CACHE_SHARE = 0.25

log = logging.getLogger("mlx_batchd.engine")


def buffer_cache_limit(settings: EngineSettings) -> int:
    """Bytes of freed buffers the engine's process lets MLX keep for reuse.

    MLX's own default lets the cache grow to its memory limit, which on CUDA is 95 % of the device's
    memory, as if no other process used the GPU. A batch's KV caches are re-made at a new batch size
    each time sequences join or finish, so the cache fills with buffers of sizes never asked for again
    until a step fails to allocate (seen with an 8B model at B = 128). A quarter of the limit leaves
    the step's working set its reuse and the device room for its neighbours."""
    if settings.mlx_cache_limit_bytes is not None:
        return settings.mlx_cache_limit_bytes
    return int(CACHE_SHARE * mx.get_memory_limit())


def check_environment() -> None:
    """Read every ``MLX_BATCHD_*`` setting that picks kernels now, so that a value that is not one of
    its own fails here, in one line (``SettingError``), and not at the first forward that reads it.
    Also point MLX CUDA's compiled-kernel cache into the project's cache folder (unless the operator
    set ``MLX_PTX_CACHE_DIR``)."""
    import os

    from workers import envs
    from workers.kernels import fastpath, rowkernel

    envs.check()
    fastpath.detect()
    rowkernel.implementation()
    # MLX CUDA keeps the kernels it compiles at first use on disk; kept beside the project's other
    # caches they outlive the temporary folder, so a later start skips those compiles.
    os.environ.setdefault("MLX_PTX_CACHE_DIR", str(Path(envs.read(envs.CACHE)) / "ptx"))


def warm_up(engine: Engine) -> None:
    """Run tiny jobs through the engine so the first clients do not pay for lazy setup: one alone
    (a lone sequence's prefill and decode), then two of different lengths together (a prefill wave
    with padding, masked batched decode, a batch that shrinks). Those run different kernels, and MLX
    CUDA compiles each kernel at its first use on a machine, so without the batched warm-up the
    first concurrent requests would wait for those compiles."""
    for jobs in (
        [Job(seq=-1, prompt=[0, 0], max_tokens=2)],
        [Job(seq=-2, prompt=[0, 0], max_tokens=2), Job(seq=-3, prompt=[0, 0, 0], max_tokens=3)],
    ):
        for job in jobs:
            engine.submit(job)
        while engine.has_work:
            engine.step()


def check_same_settings(world: World, settings: EngineSettings) -> None:
    """Every rank must run the engine with rank 0's options (batch sizes, drafter, probe): they
    decide which forwards run. A rank started with other options stops every rank, in one line."""
    text = json.dumps(asdict(settings), sort_keys=True, default=str).encode()
    check_same(
        world,
        hashlib.blake2b(text, digest_size=16).digest(),
        "engine options",
        "start every rank with the same serve options",
    )


class RankZeroStore(VerdictStore):
    """The verdict store as every rank sees it: rank 0 reads its own and broadcasts what it found
    (or that it found nothing), the others take that; only rank 0 writes. A probe that one rank
    skipped on a stored verdict while another ran it would leave the two in different forwards."""

    def __init__(self, inner: VerdictStore | None, world: World) -> None:
        super().__init__(inner.root if inner is not None else Path("."))
        self._inner = inner
        self._world = world
        self._broadcast = Broadcaster(world)

    def get(self, fingerprint: str) -> Verdict | None:
        if self._world.leader:
            found = None if self._inner is None else self._inner.get(fingerprint)
            self._broadcast(None if found is None else json.dumps(found.to_json()))
            return found
        data = self._broadcast()
        if data is None:
            return None
        try:
            verdict = Verdict.from_json(json.loads(data))
        except ValueError as exc:
            raise DistributedError(
                f"rank {self._world.rank}: rank 0's stored verdict does not read here: {exc}"
            ) from None
        verdict.from_cache = True
        return verdict

    def put(self, verdict: Verdict) -> None:
        if self._world.leader and self._inner is not None:
            self._inner.put(verdict)


def start_probe(
    engine: Engine,
    loaded: LoadedModel,
    s: EngineSettings,
    drafter: str,
    k: int,
    world: World | None = None,
    fixed_k: bool = False,
) -> str:
    """Queue the start-up probe for a pairing (memoised on disk by fingerprint); return its name.
    Its verdict lands after the verify is built at every block length the drafter can ask for
    (``fixed_k``: it always proposes ``k``, ``Drafter.fixed_k``). It starts once the start-up work
    queued before it ended (``Background.then``): its pairing names the kernel plans installed.

    Across ranks the verdict is per world: the pairing includes the world size, backend and split,
    rank 0's store answers for every rank (``RankZeroStore``), and only rank 0 fingerprints the
    model (two ranks on one machine would otherwise write the same memo file at once)."""
    name = f"{loaded.info.name}+{drafter} k={k}"

    def start() -> None:
        if world is None or not world.distributed:
            setup = probe_setup(loaded, drafter)
        else:
            setup = probe_setup(loaded, drafter) if world.leader else _follower_probe_setup(loaded)
            mode = "none" if loaded.shard is None else loaded.shard.mode
            split = {"world_size": world.size, "backend": world.backend, "mode": mode}
            store = RankZeroStore(setup.store, world)
            setup = replace(setup, pairing={**setup.pairing, "distributed": split}, store=store)
        warm = block_lengths(k, fixed_k)
        engine.start_probe(name, setup.steps(engine.counted, k, s.probe_policy, warm=warm, max_batch=engine.max_batch))

    engine.background.then("probe", start)
    return name


def _follower_probe_setup(loaded: LoadedModel) -> ProbeSetup:
    """A rank other than 0's probe set-up: the same caches and draws, no pairing of its own (rank
    0's store answers, ``RankZeroStore``)."""
    from mlx_lm.models.cache import make_prompt_cache

    def make_cache() -> list[Any]:
        return make_prompt_cache(loaded.model)

    return ProbeSetup(
        make_cache=make_cache,
        pairing={"rank_of_several": True},
        store=None,
        vocab_size=loaded.info.vocab_size,
        context_length=loaded.info.context_length,
        window=sliding_window(loaded.config),
    )


def configure_bursts(engine: Engine, loaded: LoadedModel, s: EngineSettings, world: World | None = None) -> None:
    """Load the drafter, check it fits the target, and probe the pairing in the background."""
    from workers.engine.spec.drafters import load_drafter, load_mtp_drafter

    if s.mtp is not None:
        drafter = load_mtp_drafter(s.mtp, loaded.model)
    else:
        assert s.draft is not None
        drafter = load_drafter(s.draft, loaded.model, loaded.info.vocab_size)
    name = start_probe(engine, loaded, s, drafter.name, s.bursts.k, world, drafter.fixed_k)
    engine.configure_bursts(drafter, s.bursts, name)


def quantization_line(config: dict[str, Any], model: Any) -> str:
    """The weights' quantization as a reader wants it: ``4-bit, group 32`` (with the scales' dtype),
    or the dtype of unquantized weights."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q:
        scales = next((v.dtype for k, v in params.items() if k.endswith(".scales")), None)
        mixed = " (mixed per layer)" if any(isinstance(v, dict) for v in q.values()) else ""
        dtype = "" if scales is None else f", {str(scales).removeprefix('mlx.core.')} scales"
        return f"{q['bits']}-bit, group {q.get('group_size', '?')}{mixed}{dtype}"
    weight = next((v for k, v in params.items() if k.endswith("weight")), None)
    return "none" if weight is None else f"none ({str(weight.dtype).removeprefix('mlx.core.')})"


def chosen_lines(loaded: LoadedModel, s: EngineSettings, engine: Engine) -> list[str]:
    """What the engine serves with, in a few readable lines for the start-up log: model,
    quantization, context, drafter, prefix cache."""
    info = loaded.info
    drafter = s.mtp and f"MTP head {s.mtp}" or s.draft or "none (no speculative bursts)"
    burst = f", K = {s.bursts.k}" if s.draft is not None or s.mtp is not None else ""
    cache = engine.prefix_cache
    if cache is None or cache.max_bytes <= 0:
        prefix = "off (--prefix-cache-mb 0)"
    elif cache.verdict is None:
        prefix = f"up to {cache.max_bytes / 2**20:g} MiB, off until its check (between steps) passes"
    else:
        state = "serving" if cache.serving else "declined"
        stored = " (stored check)" if cache.verdict.from_cache else ""
        prefix = f"up to {cache.max_bytes / 2**20:g} MiB, {state}{stored}: {cache.verdict.reason}"
    return [
        f"model:          {info.name} ({info.model_type}, {info.path})",
        f"quantization:   {quantization_line(loaded.config, loaded.model)}",
        f"context:        {info.context_length} tokens, {info.kv_bytes_per_token} bytes of KV a token",
        f"drafter:        {drafter}{burst}",
        f"prefix cache:   {prefix}",
        f"dense shadow:   {shadow_line(loaded)}",
    ]


def shadow_line(loaded: LoadedModel) -> str:
    """The dense shadow as ``configure_dense_shadow`` chose it, in the banner's words."""
    from workers.kernels import dense_shadow

    choice = dense_shadow.chosen(loaded.model)
    return "off (--dense-shadow off)" if choice is None else choice.line()


def configure_dense_shadow(loaded: LoadedModel, s: EngineSettings) -> None:
    """Make the dense shadow (``workers.kernels.dense_shadow``) as ``--dense-shadow`` asks, before the
    engine reads its kernel plans (their key says whether it is on). ``auto`` leaves free the KV
    budget, or without one ``RESERVE_TOKENS`` of KV for each of ``max_batch`` sequences."""
    from workers.kernels import dense_shadow

    info = loaded.info
    tokens = min(dense_shadow.RESERVE_TOKENS, info.context_length)
    reserve = s.kv_budget_bytes or s.max_batch * tokens * info.kv_bytes_per_token
    dense_shadow.configure(loaded.model, s.dense_shadow, reserve)


def configure_prefix_cache(engine: Engine, loaded: LoadedModel, s: EngineSettings) -> None:
    """Install the prefix cache, gated by its warm-vs-cold check: a stored result at once, else the
    cache starts off (no verdict) and the check runs between steps, after the kernel plans (its
    pairing names them), and sets the verdict at its end. Not across ranks: which prompts hit is
    decided per rank by its own cache's bytes and evictions."""
    if loaded.shard is not None:
        raise DistributedError("--prefix-cache-mb cannot serve across ranks yet; leave it at 0 under mlx.launch")
    from workers.engine.prefix_cache import Check, CheckStore, PrefixCache, log_verdict
    from workers.exact import unpinned
    from workers.models import cache_dir

    cache = engine.prefix_cache = PrefixCache(s.prefix_cache_bytes, None, s.probe_policy.allow_inexact)

    def check() -> Check:
        # Keyed like the probe's verdicts (weights, config, caches, backend, kernels), so a result
        # measured once serves every later start of the same set-up.
        return Check(
            engine.counted,
            s.prefill_step,
            loaded.info.vocab_size,
            sliding_window(loaded.config),
            loaded.info.context_length,
            CheckStore(cache_dir() / "prefix-checks"),
            probe_setup(loaded, "none", store=False).pairing,
        )

    def settle(verdict: ReuseVerdict) -> None:
        log_verdict(verdict, cache.allow_inexact)
        cache.verdict = verdict

    found = None if engine.background.pending else check().stored()
    if found is not None:
        settle(found)
        return

    def steps() -> Generator[str, None, ReuseVerdict]:
        return (yield from check().steps())  # made when it starts: after the kernel plans

    engine.background.add("prefix check", engine.paced(steps()), settle, lambda: unpinned("probe"))


def build_engine(loaded: LoadedModel, s: EngineSettings, world: World, clock: PhaseClock | None = None) -> Engine:
    """The engine for ``loaded`` as the settings ask, warmed up, with its prefix cache, drafter and
    probe configured and its counters reset: what an engine thread serves once it says ``Ready``.
    What is not stored yet (kernel plans, the prefix cache's check) is queued to run between steps,
    and the probe after it. Each phase's seconds go on ``clock``."""
    clock = clock or PhaseClock()
    with clock.phase("dense shadow"):
        configure_dense_shadow(loaded, s)
    with clock.phase("engine"):
        engine = Engine(
            loaded.model,
            calibration="background",
            eos_token_ids=loaded.info.eos_token_ids,
            vocab_size=loaded.info.vocab_size,
            max_batch=s.max_batch,
            prefill_batch=s.prefill_batch,
            prefill_step=s.prefill_step,
            prefill_tokens=s.prefill_tokens,
            step_target_s=s.step_target_s,
            lockstep=world.distributed,
        )
    engine.tokenizer = loaded.tokenizer
    with clock.phase("warm-up"):
        warm_up(engine)
    if s.prefix_cache_bytes > 0:
        with clock.phase("prefix cache"):
            configure_prefix_cache(engine, loaded, s)
    if s.draft is not None or s.mtp is not None:
        with clock.phase("drafter"):
            configure_bursts(engine, loaded, s, world)
    elif s.probe_k is not None:
        with clock.phase("probe set-up"):
            start_probe(engine, loaded, s, s.drafter, s.probe_k, world)
    engine.reset_counters()
    if world.leader:
        for line in chosen_lines(loaded, s, engine):
            log.info("serving with %s", line)
        if engine.background.pending:
            log.info("start-up work, run between steps once ready: %s", ", ".join(engine.start_up_summary()))
    return engine
