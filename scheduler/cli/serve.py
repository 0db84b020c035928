"""``mlx-batchd serve``: run the daemon.

The parser holds every knob of the daemon (front end, engine, bursts, prefix cache, HTTP); the
command turns them into the daemon's settings. The address and key file are checked before MLX is
imported, so a typo costs a second, not a model load.

Started by ``mlx.launch`` (or any launcher that sets ``MLX_RANK`` and the backend's variables) the
same command runs one daemon over several ranks (docs/distributed.md): rank 0 serves as usual and
its engine process leads; every other rank runs only a follower engine on its shard and ignores the
front end's options. A set-up that cannot serve is refused on every rank, in one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from clients.address import default_address
from clients.protocol import DEFAULT_MAX_FRAME_BYTES
from scheduler.cli.errors import address_and_source, check_address, check_key_file, local_command
from scheduler.cli.options import (
    Parser,
    add_probe_policy,
    float_in,
    fraction,
    host_port,
    http_address,
    int_in,
    non_negative_float,
    positive_float,
    positive_int,
    probe_policy,
)
from workers.prefill_wave import PREFILL_TOKENS

if TYPE_CHECKING:
    from workers.loop import EngineSettings

#: The smallest ``--max-frame-bytes`` that still fits a short request with its options.
MIN_FRAME_BYTES = 1024
#: ``--prefix-cache-mb`` when not given: an upper bound, not an allocation (entries fill it as
#: sequences end); 512 MiB holds 4,096 tokens of an 8B llama's KV (128 KiB a token), or a 135M
#: model's whole context many times over.
DEFAULT_PREFIX_CACHE_MB = 512.0
#: With ``--kv-budget-mb`` and no ``--prefix-cache-mb``, the prefix cache takes this share of the
#: budget (at most ``DEFAULT_PREFIX_CACHE_MB``), leaving requests the rest.
PREFIX_CACHE_SHARE = 0.25
#: Variables a launcher sets on every rank (``mlx.launch`` always sets ``MLX_RANK``); without one
#: of them the process is not one of several and nothing distributed is imported.
_LAUNCH_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``serve``."""
    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument(
        "--model",
        default="demo",
        help="a local mlx-lm model directory, a GGUF file (converted once into the cache), ollama:NAME[:TAG] "
        "(from Ollama's local store), or 'demo' (default)",
    )
    p.add_argument("--listen", default=None, help=f"ZeroMQ address to bind (default {default_address()})")
    p.add_argument("--max-batch", type=positive_int, default=32, help="most sequences decoded together")
    p.add_argument(
        "--prefill-batch",
        type=positive_int,
        default=None,
        help="most prompts prefilled together (default: --max-batch; --prefill-tokens sizes each wave)",
    )
    p.add_argument("--prefill-step", type=positive_int, default=2048, help="prompt tokens per prefill chunk")
    p.add_argument(
        "--prefill-tokens",
        type=positive_int,
        default=PREFILL_TOKENS,
        help="prompt tokens one prefill step carries across the prompts it prefills together",
    )
    p.add_argument(
        "--admit-window-ms",
        type=float_in(0.0, 60_000.0),
        default=20.0,
        help="while the engine has work, an arrival waits at most this long for others to join the batch "
        "with it in one prefill wave (0 = next iteration)",
    )
    p.add_argument(
        "--admit-idle-window-ms",
        type=float_in(0.0, 1_000.0),
        default=10.0,
        help="arrivals that find the engine idle wait until none has come for this long (at most 5 times "
        "it, and at least 50 ms), so that clients starting together join in one prefill wave (0 = at once)",
    )
    p.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="let MLX CUDA run attention through cuDNN (off by default: it builds a graph per new prompt "
        "shape, which new prompt lengths pay in time to first token; MLX_CUDA_USE_CUDNN_SDPA overrides)",
    )
    p.add_argument(
        "--mlx-cache-limit-mb",
        type=float_in(0.0, float(2**30)),
        default=None,
        help="MiB of freed buffers MLX may keep for reuse (default: a quarter of MLX's memory limit)",
    )
    p.add_argument("--max-tokens-cap", type=positive_int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--default-max-tokens", type=positive_int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--context-length", type=positive_int, default=None, help="override the model's context length")
    p.add_argument(
        "--max-frame-bytes",
        type=int_in(MIN_FRAME_BYTES, 2**30),
        default=DEFAULT_MAX_FRAME_BYTES,
        help="largest request frame accepted",
    )
    p.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=0.0,
        help="on SIGTERM/SIGINT, let in-flight requests finish for up to this many seconds",
    )
    p.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the engine on a thread of the daemon instead of its own process (one GIL for both)",
    )
    p.add_argument(
        "--cpu-affinity",
        choices=["split", "off"],
        default="split",
        help="split (Linux, 2+ CPUs): the front end on its own CPUs (1 in 8, 1 to 4), the engine process "
        "on the rest, within the CPUs the daemon was given; off: the OS places both (several daemons "
        "sharing a small machine)",
    )
    p.add_argument(
        "--pin-scope",
        choices=["scoped", "process"],
        default="scoped",
        help="scoped: only verify forwards run pinned; process: every forward (the seed's way, for comparison)",
    )
    p.add_argument(
        "--probe-k",
        type=positive_int,
        default=None,
        help="without a drafter: probe the verify pairing for K drafted tokens at start-up",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="speculative drafter for B = 1 bursts: a draft model directory, 'demo' or 'prompt-lookup'",
    )
    p.add_argument("--mtp", default=None, help="an MTP head directory (or 'demo') as the drafter")
    p.add_argument(
        "-k",
        type=positive_int,
        default=None,
        help="drafted tokens per burst round (the verify block is K + 1); default 7 for an MTP head, else 4",
    )
    p.add_argument(
        "--audit-fraction",
        type=fraction,
        default=0.02,
        help="fraction of burst rounds re-checked against a single-token forward",
    )
    p.add_argument(
        "--lookahead",
        choices=("auto", "on", "off"),
        default="auto",
        help="build a burst round's verify while the previous round runs: auto (time rounds each way, "
        "keep the faster), on (whenever it can), off",
    )
    p.add_argument(
        "--draft-in-verify",
        choices=("on", "off"),
        default="on",
        help="a drafter that drafts on the device (MTP) has its drafts computed with the verify in one "
        "evaluation (on), or evaluated before the verify is built (off)",
    )
    p.add_argument("--max-queued", type=positive_int, default=1024, help="requests waiting for a slot before `busy`")
    p.add_argument("--tenants", default=None, help="tenants TOML file (keys, weights, limits); reloaded on SIGHUP")
    p.add_argument("--curve-secret", default=None, help="the daemon's CURVE secret key file")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow tcp:// or a non-loopback --http without authentication (not recommended)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=non_negative_float,
        default=None,
        help="keep up to this much prompt KV for reuse by later requests sharing a prefix, per tenant "
        f"(docs/prefix-cache.md); counted in --kv-budget-mb. Default {DEFAULT_PREFIX_CACHE_MB:g}, or a "
        f"{PREFIX_CACHE_SHARE:g} share of --kv-budget-mb when one is set; off (0) under mlx.launch; 0 = off",
    )
    p.add_argument(
        "--kv-budget-mb",
        type=non_negative_float,
        default=0.0,
        help="KV cache the admitted requests may reserve (prompt + max_tokens each); 0 = no cap",
    )
    p.add_argument(
        "--max-inflight-per-client",
        type=positive_int,
        default=256,
        help="requests one connection may have in flight before `busy`",
    )
    p.add_argument(
        "--max-unsent-per-client",
        type=positive_int,
        default=1000,
        help="messages queued for one slow reader before its sequences pause until it catches up",
    )
    p.add_argument(
        "--park-after",
        type=positive_float,
        default=5.0,
        help="seconds a connection that stopped reading keeps its decode slots; then its sequences are "
        "parked (KV kept) and the slots go to others until it reads again",
    )
    p.add_argument(
        "--park-timeout",
        type=positive_float,
        default=600.0,
        help="seconds a connection may read nothing before its requests end `disconnected`",
    )
    p.add_argument(
        "--metrics", type=host_port, default=None, help="serve Prometheus metrics on HOST:PORT (e.g. 127.0.0.1:9464)"
    )
    p.add_argument(
        "--http",
        type=http_address,
        default=None,
        help="also serve the OpenAI-compatible HTTP API on HOST:PORT (e.g. 127.0.0.1:8000; docs/http.md)",
    )
    p.add_argument(
        "--http-body-timeout",
        type=positive_float,
        default=30.0,
        help="seconds an HTTP client has to send its request body (then 408)",
    )
    p.add_argument(
        "--http-max-connections",
        type=positive_int,
        default=1024,
        help="HTTP connections held at once (lowered to fit the descriptor limit); past it 503 at once",
    )
    p.add_argument(
        "--http-local-auth",
        choices=("uid", "key"),
        default="uid",
        help="without --tenants, local HTTP serves only the daemon's user: uid (the peer's uid on Linux, "
        "else the key in a 0600 file next to the socket, path logged at start) or key (always that key)",
    )
    p.add_argument(
        "--rank-timeout",
        type=non_negative_float,
        default=60.0,
        help="under mlx.launch: seconds one engine iteration may take before a rank presumes a peer "
        "gone and stops every rank (0 = never)",
    )
    p.add_argument(
        "--engine-timeout",
        type=non_negative_float,
        default=60.0,
        help="seconds the engine process may owe work (requests running, a shutdown) without a word before "
        "the daemon presumes it hung: every request ends engine_dead, health turns 503, exit 1 (0 = never)",
    )
    add_probe_policy(p)
    p.set_defaults(func=local_command("serve", run))


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    """The engine's options from the command line: the same on every rank."""
    from workers.burst import BurstSettings, default_k
    from workers.loop import EngineSettings

    return EngineSettings(
        max_batch=args.max_batch,
        prefill_batch=args.prefill_batch,
        prefill_step=args.prefill_step,
        prefill_tokens=args.prefill_tokens,
        admit_window_s=args.admit_window_ms / 1e3,
        admit_idle_window_s=args.admit_idle_window_ms / 1e3,
        cudnn_attention=args.cudnn_attention,
        mlx_cache_limit_bytes=None if args.mlx_cache_limit_mb is None else int(args.mlx_cache_limit_mb * 2**20),
        pin_scope=args.pin_scope,
        probe_k=args.probe_k,
        probe_policy=probe_policy(args),
        draft=args.draft,
        mtp=args.mtp,
        bursts=BurstSettings(
            k=args.k if args.k is not None else default_k(args.mtp is not None),
            audit_fraction=args.audit_fraction,
            lookahead=args.lookahead != "off",
            lookahead_choice=args.lookahead == "auto",
            draft_in_verify=args.draft_in_verify == "on",
        ),
        prefix_cache_bytes=int(prefix_cache_mb(args) * 2**20),
        rank_timeout_s=args.rank_timeout,
    )


def prefix_cache_mb(args: argparse.Namespace) -> float:
    """The prefix cache's bound in MiB: what the user gave, else off under a launcher (it cannot serve
    across ranks), else a share of the KV budget when there is one, else ``DEFAULT_PREFIX_CACHE_MB``."""
    if args.prefix_cache_mb is not None:
        return float(args.prefix_cache_mb)
    if any(v in os.environ for v in _LAUNCH_VARS):
        return 0.0
    if args.kv_budget_mb:
        return min(DEFAULT_PREFIX_CACHE_MB, PREFIX_CACHE_SHARE * args.kv_budget_mb)
    return DEFAULT_PREFIX_CACHE_MB


def run(args: argparse.Namespace) -> int:
    """Run the daemon, or under a launcher this rank's part of it. The address and key file are
    checked here, before MLX is imported; the model and drafters by ``scheduler.daemon.serve``,
    before the socket is bound."""
    if any(v in os.environ for v in _LAUNCH_VARS):
        from workers.distributed import DistributedError, launched_rank

        rank = launched_rank(os.environ)
        if rank is not None:
            try:
                check_ranks(args)
            except DistributedError as exc:
                print(f"mlx-batchd serve: rank {rank}: {' '.join(str(exc).split())}", file=sys.stderr)
                return 2
            if rank != 0:
                from scheduler.engine_process import follower_main

                grace = args.drain_timeout + (args.rank_timeout or 60.0)  # rank 0's drain, then one iteration
                return follower_main(args.model, args.context_length, engine_settings(args), grace)
    return run_daemon(args)


def check_ranks(args: argparse.Namespace) -> None:
    """What would stop a daemon over several ranks, found on each rank before anything is bound or
    joined: options that cannot serve across ranks, a family mlx-lm cannot split, heads that do not
    divide (``DistributedError``). Different weights are found once the ranks meet, at load."""
    from workers.distributed import DistributedError, launched_size
    from workers.models import check_sharding

    if args.engine_thread:
        raise DistributedError("--engine-thread cannot serve across ranks: the engine process joins the group")
    if args.prefix_cache_mb:  # only when given: the default is 0 under a launcher
        raise DistributedError("--prefix-cache-mb cannot serve across ranks yet; leave it at 0 under mlx.launch")
    size = launched_size(os.environ)
    if size is not None and size > 1:
        check_sharding(args.model, size)


def run_daemon(args: argparse.Namespace) -> int:
    """The daemon itself (alone, or rank 0 of several)."""
    listen, source = address_and_source(args.listen, "--listen")
    check_address(listen, source)
    if args.curve_secret is not None:
        check_key_file(args.curve_secret, "--curve-secret", secret=True)

    from scheduler.admission import Limits
    from scheduler.http_limits import descriptor_limit_raised

    with descriptor_limit_raised():  # mlx-lm's import lowers RLIMIT_NOFILE to (2048, 4096)
        from scheduler.daemon import DaemonSettings, serve
    from scheduler.frontend import FrontEndSettings

    front = FrontEndSettings(
        listen=listen,
        limits=Limits(max_tokens_cap=args.max_tokens_cap, default_max_tokens=args.default_max_tokens),
        max_frame_bytes=args.max_frame_bytes,
        drain_timeout=args.drain_timeout,
        max_queued=args.max_queued,
        tenants=Path(args.tenants) if args.tenants else None,
        curve_secret=Path(args.curve_secret) if args.curve_secret else None,
        insecure=args.insecure,
        metrics=args.metrics,
        kv_budget_bytes=int(args.kv_budget_mb * 2**20),
        max_inflight_per_client=args.max_inflight_per_client,
        max_unsent_per_client=args.max_unsent_per_client,
        park_after_s=args.park_after,
        park_timeout_s=args.park_timeout,
        http=args.http,
        http_body_timeout_s=args.http_body_timeout,
        http_max_connections=args.http_max_connections,
        http_local_auth=args.http_local_auth,
    )
    settings = DaemonSettings(
        front,
        model=args.model,
        context_length=args.context_length,
        engine=engine_settings(args),
        engine_process=not args.engine_thread,
        cpu_affinity=args.cpu_affinity,
        engine_timeout_s=args.engine_timeout,
    )
    return serve(settings)
