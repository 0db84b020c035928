"""``mlx-batchd serve``: run the daemon.

The parser holds the operator's options (model, addresses, batch and limits, tenants, drafter, cache
sizes); the other settings are keys of ``--config FILE.toml`` (``serve_keys``), read in before the
command runs, under the options given on the command line. The command turns them into the daemon's
settings. The file, the address and the key file are checked before MLX is imported, so a typo costs
a second, not a model load.

Started by ``mlx.launch`` (or any launcher that sets ``MLX_RANK`` and the backend's variables) the
same command runs one daemon over several ranks (docs/distributed.md): rank 0 serves as usual and
its engine process leads; every other rank runs only a follower engine on its shard and ignores the
front end's options. A set-up that cannot serve is refused on every rank, in one line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from clients.address import default_address
from scheduler.cli import config_file
from scheduler.cli.config_file import add_keys, track_given
from scheduler.cli.errors import address_and_source, check_address, check_key_file, local_command
from scheduler.cli.options import (
    Parser,
    chat_template_file,
    host_port,
    http_address,
    non_negative_float,
    positive_int,
    probe_policy,
)
from scheduler.cli.serve_keys import FILE_KEYS

if TYPE_CHECKING:
    from scheduler.daemon import DaemonSettings
    from workers.api import EngineSettings

#: ``--log-level``'s choices, and the format of the daemon's log lines.
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
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
    p = sub.add_parser(
        "serve",
        help="run the daemon",
        description="Run the daemon. The settings not listed here (engine tuning, connection limits, "
        "timeouts, the start-up probe's policy) are keys of --config FILE.toml, as are these options; an "
        "option given here wins over the file. docs/configuration.md lists every key.",
    )
    track_given(p)  # before the options: the file does not override what the command line gives
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="a TOML file of settings (docs/configuration.md); unknown keys and wrong types are refused",
    )
    p.add_argument(
        "--model",
        default="demo",
        help="a local mlx-lm model directory, a GGUF file (converted once into the cache), ollama:NAME[:TAG] "
        "(from Ollama's local store), or 'demo' (default)",
    )
    p.add_argument("--listen", default=None, help=f"ZeroMQ address to bind (default {default_address()})")
    p.add_argument("--max-batch", type=positive_int, default=32, help="most sequences decoded together")
    p.add_argument("--max-tokens-cap", type=positive_int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--default-max-tokens", type=positive_int, default=256, help="max_tokens when a request gives none")
    p.add_argument(
        "--context-length",
        type=positive_int,
        default=None,
        help="override the model's context length (default: the model's)",
    )
    p.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=0.0,
        help="on SIGTERM/SIGINT, let in-flight requests finish for up to this many seconds",
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
        "--metrics", type=host_port, default=None, help="serve Prometheus metrics on HOST:PORT (e.g. 127.0.0.1:9464)"
    )
    p.add_argument(
        "--http",
        type=http_address,
        default=None,
        help="also serve the OpenAI-compatible HTTP API on HOST:PORT (e.g. 127.0.0.1:8000; docs/http.md)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        type=chat_template_file,
        default=None,
        help="a Jinja chat template to use instead of the model's own (for chat messages on every door)",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="the daemon's log level")
    add_keys(p, FILE_KEYS)
    p.set_defaults(func=local_command("serve", _configured(p)))


def _configured(parser: Parser) -> Callable[[argparse.Namespace], int]:
    """``run``, once ``--config``'s settings are read into the options the command line left unset
    (a file that cannot be used is one line, exit 2) and logging is set to ``--log-level``."""

    def command(args: argparse.Namespace) -> int:
        try:
            config_file.apply(args, config_file.keys_of(parser, FILE_KEYS))
        except config_file.ConfigFileError as exc:
            print(f"mlx-batchd serve: {exc}", file=sys.stderr)
            return 2
        logging.basicConfig(format=LOG_FORMAT)  # the daemon's own basicConfig then finds it done
        logging.getLogger().setLevel(args.log_level.upper())
        return run(args)

    return command


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    """The engine's options from the command line: the same on every rank."""
    from scheduler.engine_watchdog import STEP_TARGET_SHARE
    from workers.api import BurstSettings, EngineSettings, default_k

    return EngineSettings(
        max_batch=args.max_batch,
        prefill_batch=args.prefill_batch,
        prefill_step=args.prefill_step,
        prefill_tokens=args.prefill_tokens,
        admit_window_s=args.admit_window_ms / 1e3,
        admit_idle_window_s=args.admit_idle_window_ms / 1e3,
        cudnn_attention=args.cudnn_attention,
        mlx_cache_limit_bytes=None if args.mlx_cache_limit_mb is None else int(args.mlx_cache_limit_mb * 2**20),
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
        # Prefill steps short enough for the watchdog to hear each in time (``engine_watchdog``).
        step_target_s=STEP_TARGET_SHARE * args.engine_timeout,
        dense_shadow=args.dense_shadow,
        kv_budget_bytes=int(args.kv_budget_mb * 2**20),
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
        from workers.dist import DistributedError, launched_rank

        rank = launched_rank(os.environ)
        if rank is not None:
            try:
                check_ranks(args)
            except DistributedError as exc:
                print(f"mlx-batchd serve: rank {rank}: {' '.join(str(exc).split())}", file=sys.stderr)
                return 2
            if rank != 0:
                from scheduler.engine_child import follower_main

                grace = args.drain_timeout + (args.rank_timeout or 60.0)  # rank 0's drain, then one iteration
                return follower_main(args.model, args.context_length, engine_settings(args), grace)
    return run_daemon(args)


def check_ranks(args: argparse.Namespace) -> None:
    """What would stop a daemon over several ranks, found on each rank before anything is bound or
    joined: options that cannot serve across ranks, a family mlx-lm cannot split, heads that do not
    divide (``DistributedError``). Different weights are found once the ranks meet, at load."""
    from workers.dist import DistributedError, launched_size
    from workers.models.loading import check_sharding

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

    from scheduler.engine_spawn import spawn
    from scheduler.lean_imports import keep_out

    # The engine process imports the engine while this one imports the front end and checks the rest.
    spawned = spawn()
    keep_out()  # before the model check's and the tokenizer's imports of mlx-lm
    try:
        from scheduler.http_limits import descriptor_limit_raised

        with descriptor_limit_raised():  # mlx-lm's import lowers RLIMIT_NOFILE to (2048, 4096)
            from scheduler.daemon import serve
        settings = daemon_settings(args, listen)
    except BaseException:
        spawned.discard()
        raise
    return serve(settings, spawned)


def daemon_settings(args: argparse.Namespace, listen: str) -> DaemonSettings:
    """The parsed options as the daemon's settings."""
    from scheduler.admission import Limits
    from scheduler.daemon import DaemonSettings
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
        zmq_max_connections=args.zmq_max_connections,
        http_local_auth=args.http_local_auth,
        chat_template=args.chat_template,
    )
    settings = DaemonSettings(
        front,
        model=args.model,
        context_length=args.context_length,
        engine=engine_settings(args),
        cpu_affinity=args.cpu_affinity,
        engine_timeout_s=args.engine_timeout,
    )
    return settings
