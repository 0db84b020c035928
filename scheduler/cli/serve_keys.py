"""The settings of ``mlx-batchd serve`` that live in its config file only (``--config FILE.toml``,
docs/configuration.md): engine tuning, connection limits, timeouts and the start-up probe's policy.

The operator's options (model, addresses, batch and limits, tenants, drafter, cache sizes) stay on
the command line (``serve``) and are keys of the file too. An ``alias`` is still accepted, hidden,
as an option, because tests and benchmark scripts pass it so.
"""

from __future__ import annotations

from clients.protocol import DEFAULT_MAX_FRAME_BYTES
from scheduler.cli.config_file import Key
from scheduler.cli.options import (
    PIN_LEVELS,
    float_in,
    fraction,
    int_in,
    non_negative_float,
    positive_float,
    positive_int,
)
from workers.api import PREFILL_TOKENS

#: The smallest ``max_frame_bytes`` that still fits a short request with its options.
MIN_FRAME_BYTES = 1024

FILE_KEYS: tuple[Key, ...] = (
    # -- batching
    Key(
        "prefill_batch",
        int,
        None,
        "most prompts prefilled together (default: max_batch; prefill_tokens sizes each wave)",
        positive_int,
        alias=True,
    ),
    Key("prefill_step", int, 2048, "prompt tokens per prefill chunk", positive_int, alias=True),
    Key(
        "prefill_tokens",
        int,
        PREFILL_TOKENS,
        "prompt tokens one prefill step carries across the prompts it prefills together",
        positive_int,
    ),
    Key(
        "admit_window_ms",
        float,
        20.0,
        "while the engine has work, an arrival waits at most this long for others to join the batch with it "
        "in one prefill wave (0 = next iteration)",
        float_in(0.0, 60_000.0),
        alias=True,
    ),
    Key(
        "admit_idle_window_ms",
        float,
        10.0,
        "arrivals that find the engine idle wait until none has come for this long (at most 5 times it, and "
        "at least 50 ms), so that clients starting together join in one prefill wave (0 = at once)",
        float_in(0.0, 1_000.0),
        alias=True,
    ),
    # -- MLX and processes
    Key(
        "cudnn_attention",
        bool,
        False,
        "let MLX CUDA run attention through cuDNN (off: it builds a graph per new prompt shape, which new "
        "prompt lengths pay in time to first token; MLX_CUDA_USE_CUDNN_SDPA overrides)",
        alias=True,
    ),
    Key(
        "mlx_cache_limit_mb",
        float,
        None,
        "MiB of freed buffers MLX may keep for reuse (default: a quarter of MLX's memory limit)",
        float_in(0.0, float(2**30)),
        alias=True,
    ),
    Key(
        "dense_shadow",
        str,
        "off",
        "keep a dequantized copy of the 4/8-bit projections' weights, which calibration routes large batches "
        "through where it times cheaper: on, auto (only where the memory free leaves the KV budget), off; its "
        "bytes are in stats (engine.dense_shadow_bytes)",
        choices=("off", "auto", "on"),
        alias=True,
    ),
    Key(
        "cpu_affinity",
        str,
        "split",
        "split (Linux, 2+ CPUs): the front end on its own CPUs (1 in 8, 1 to 4), the engine process on the "
        "rest, within the CPUs the daemon was given; off: the OS places both (several daemons sharing a "
        "small machine)",
        choices=("split", "off"),
        alias=True,
    ),
    # -- speculation
    Key(
        "audit_fraction",
        float,
        0.02,
        "fraction of burst rounds re-checked against a single-token forward",
        fraction,
        alias=True,
    ),
    Key(
        "lookahead",
        str,
        "auto",
        "build a burst round's verify while the previous round runs: auto (time rounds each way, keep the "
        "faster), on (whenever it can), off",
        choices=("auto", "on", "off"),
        alias=True,
    ),
    Key(
        "draft_in_verify",
        str,
        "on",
        "a drafter that drafts on the device (MTP) has its drafts computed with the verify in one evaluation "
        "(on), or evaluated before the verify is built (off)",
        choices=("on", "off"),
        alias=True,
    ),
    # -- the start-up probe's policy (the same keys as `mlx-batchd probe`'s options)
    Key(
        "probe_k",
        int,
        None,
        "without a drafter: probe the verify pairing for K drafted tokens at start-up (default: no probe)",
        positive_int,
        alias=True,
    ),
    Key(
        "allow_inexact",
        bool,
        False,
        "run bursts at wide even when no level is exact, marked inexact everywhere",
        alias=True,
    ),
    Key(
        "pin_level",
        str,
        None,
        "use this kernel level for verify instead of the ladder's choice (padded also pins the lone "
        "sequence's classic steps; default: the ladder's)",
        choices=PIN_LEVELS,
        alias=True,
    ),
    Key(
        "accept_classic_variation",
        bool,
        False,
        "where classic decode itself is not reproducible, accept a block no worse than its variation",
    ),
    # -- connections
    Key(
        "max_frame_bytes",
        int,
        DEFAULT_MAX_FRAME_BYTES,
        "largest request frame accepted",
        int_in(MIN_FRAME_BYTES, 2**30),
        alias=True,
    ),
    Key(
        "max_inflight_per_client",
        int,
        256,
        "requests one connection may have in flight before `busy`",
        positive_int,
        alias=True,
    ),
    Key(
        "max_unsent_per_client",
        int,
        1000,
        "messages queued for one slow reader before its sequences pause until it catches up",
        positive_int,
        alias=True,
    ),
    Key(
        "park_after",
        float,
        5.0,
        "seconds a connection that stopped reading keeps its decode slots; then its sequences are parked "
        "(KV kept) and the slots go to others until it reads again",
        positive_float,
        alias=True,
    ),
    Key(
        "park_timeout",
        float,
        600.0,
        "seconds a connection may read nothing before its requests end `disconnected`",
        positive_float,
    ),
    Key(
        "zmq_max_connections",
        int,
        256,
        "ZeroMQ connections held at once (lowered to fit the descriptor limit); a handshake past it is "
        "refused and the client library raises `too_many_connections`",
        positive_int,
    ),
    # -- HTTP
    Key(
        "http_body_timeout",
        float,
        30.0,
        "seconds an HTTP client has to send its request body (then 408)",
        positive_float,
        alias=True,
    ),
    Key(
        "http_max_connections",
        int,
        1024,
        "HTTP connections held at once (lowered to fit the descriptor limit); past it 503 at once",
        positive_int,
        alias=True,
    ),
    Key(
        "http_local_auth",
        str,
        "uid",
        "without tenants, local HTTP serves only the daemon's user: uid (the peer's uid on Linux, else the "
        "key in a 0600 file next to the socket, path logged at start) or key (always that key)",
        choices=("uid", "key"),
        alias=True,
    ),
    # -- failure detection
    Key(
        "engine_timeout",
        float,
        60.0,
        "seconds the engine process may owe work (requests running, a shutdown) without a word before the "
        "daemon presumes it hung: every request ends engine_dead, health turns 503, exit 1 (0 = never)",
        non_negative_float,
        alias=True,
    ),
    Key(
        "rank_timeout",
        float,
        60.0,
        "under mlx.launch: seconds one engine iteration may take before a rank presumes a peer gone and "
        "stops every rank (0 = never)",
        non_negative_float,
        alias=True,
    ),
)
