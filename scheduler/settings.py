"""The front end's settings, the errors a configuration that must not start raises, and the checks
that raise them before anything is started."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from clients.protocol import DEFAULT_MAX_FRAME_BYTES
from scheduler.admission import Limits
from scheduler.tenants import TenantTable, load_tenants, local_table

log = logging.getLogger("mlx_batchd")


class ConfigError(Exception):
    """A daemon configuration that must not start (with what to change)."""


class BindError(ConfigError):
    """An address the daemon cannot take (in use, in a folder others control, unparsable). Raised
    before the engine starts, so nothing is left running; the command line exits 1 for it."""


@dataclass(frozen=True)
class FrontEndSettings:
    listen: str
    limits: Limits = field(default_factory=Limits)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    drain_timeout: float = 0.0
    #: Messages one connection may have in ZeroMQ's queue (its SNDHWM). When that is full the daemon
    #: pauses the connection's sequences and keeps what they had produced in an outbox until it drains;
    #: with that many messages waiting in the outbox, the connection's new messages (except cancels)
    #: go unanswered. docs/reliability.md gives the whole bound.
    max_unsent_per_client: int = 1000
    #: Seconds a connection that stopped reading keeps its decode slots; then its sequences are
    #: parked (paused, KV kept) and the slots go to others until it reads again.
    park_after_s: float = 5.0
    #: Seconds a connection may read nothing before its requests end ``disconnected``.
    park_timeout_s: float = 600.0
    handle_signals: bool = True
    #: Sequences handed to the engine at once (its batch size); the rest wait in the fair queue.
    capacity: int = 32
    #: Requests waiting for a slot, all tenants together, before new ones are answered ``busy``.
    max_queued: int = 1024
    tenants: Path | None = None
    curve_secret: Path | None = None
    insecure: bool = False
    #: ``HOST:PORT`` for the Prometheus exposition, or ``None``.
    metrics: str | None = None
    #: KV-cache bytes the engine may hold, admitted requests (prompt + max_tokens each) and the prefix
    #: cache together; 0 = no cap.
    kv_budget_bytes: int = 0
    #: The engine's prefix-cache bound (``--prefix-cache-mb``): carved out of ``kv_budget_bytes``, so
    #: cached prefixes and running requests together stay within the budget.
    prefix_cache_bytes: int = 0
    #: Requests one connection may have in flight (waiting or decoding) before ``busy``.
    max_inflight_per_client: int = 256
    #: ``HOST:PORT`` for the OpenAI-compatible HTTP front door (``docs/http.md``), or ``None``.
    http: str | None = None
    #: Seconds an HTTP client has to send its whole request body before ``408``.
    http_body_timeout_s: float = 30.0
    #: HTTP connections held at once (lowered to fit the descriptor limit); past it, 503 and closed.
    http_max_connections: int = 1024
    #: ZeroMQ connections held at once (lowered to fit the descriptors left to ZeroMQ); a handshake
    #: past it is refused (the client library raises ``too_many_connections``).
    zmq_max_connections: int = 256
    #: Without tenants and ``insecure``, how local HTTP tells the daemon's own user: ``uid`` (the
    #: peer's uid where the OS says it, else the key file's key) or ``key`` (always the key).
    http_local_auth: str = "uid"
    #: A chat template (its text) used instead of the model's own (``--chat-template``), or ``None``.
    chat_template: str | None = None


def request_kv_budget(s: FrontEndSettings) -> int:
    """KV bytes admitted requests may reserve: the budget less the prefix cache's bound (0 = no cap)."""
    return max(0, s.kv_budget_bytes - s.prefix_cache_bytes) if s.kv_budget_bytes else 0


def load_table(s: FrontEndSettings) -> TenantTable:
    """The tenants in force, once the settings are checked for a combination that must not start
    (tenants without a CURVE key; a network address or HTTP door open to anyone, unless insecure)."""
    if s.kv_budget_bytes and s.prefix_cache_bytes >= s.kv_budget_bytes:
        raise ConfigError(
            f"--prefix-cache-mb {s.prefix_cache_bytes / 2**20:g} leaves nothing of --kv-budget-mb "
            f"{s.kv_budget_bytes / 2**20:g} for requests: the prefix cache is counted in the KV budget"
        )
    table = local_table() if s.tenants is None else load_tenants(s.tenants)
    tcp = not s.listen.startswith("ipc://")
    if table.authenticated and s.curve_secret is None:
        raise ConfigError("--tenants needs --curve-secret: tenants are identified by their CURVE keys")
    if tcp and not table.authenticated and not s.insecure:
        raise ConfigError(
            f"refusing to listen on {s.listen} without authentication: give --tenants and --curve-secret "
            "(CURVE keys from `mlx-batchd keys new NAME`), or --insecure to accept anyone who can connect"
        )
    if s.http is not None:
        from scheduler.http_auth import exposure_problem

        problem = exposure_problem(s.http, table.authenticated, s.insecure)
        if problem is not None:
            raise ConfigError(problem)
        if exposure_problem(s.http, table.authenticated, False) is not None:
            log.warning("!!! INSECURE: --http %s has no authentication; anyone who can connect can submit jobs", s.http)
    return table
