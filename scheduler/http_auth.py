"""Who an HTTP request is: API keys, their hashes in tenants.toml, and who may be served without one.

A key travels as ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``. The tenants file holds only
SHA-256 digests of keys (``api_keys_sha256``), so a copy of the file gives nobody a key; keys are long
random strings, so an unsalted digest cannot be searched for. Without a tenants file every request
belongs to the tenant ``local`` (the operator) and keys are ignored, which is safe only where nobody
else can connect: a non-loopback address is refused then, unless ``--insecure``. On loopback it is
the ipc socket's rule (``LocalUserOnly``): only the daemon's own user (and root) is served, told by
the peer's uid where the OS says it (Linux), else by a key from a 0600 file only that user can read.
``--metrics`` has no keys at all: a non-loopback address needs ``--insecure``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path

import anyio
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from scheduler.peer_uid import peer_uid
from scheduler.tenants import LOCAL, Tenant, TenantTable

#: What every generated key starts with, so a key found in a log or a repository is recognisable.
KEY_PREFIX = "mlxb-"
#: Random bytes in a key (256 bits): far beyond guessing, and beyond any search of unsalted digests.
KEY_BYTES = 32


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def key_digest(key: str) -> str:
    """The SHA-256 hex digest that tenants.toml stores for ``key``."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries (``Authorization: Bearer`` first, then ``X-Api-Key``), or ``None``."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() or None if key is not None else None


def tenant_for(table: TenantTable, headers: Mapping[str, str]) -> Tenant | None:
    """The tenant to serve, or ``None`` (answered 401, the same for a missing and a wrong key).

    Without a tenants file: ``local``, whatever key is sent (the OpenAI SDK always sends one)."""
    if not table.authenticated:
        return table.tenants[LOCAL]
    key = presented_key(headers)
    if key is None:
        return None
    return table.by_api_key_hash(key_digest(key))


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too; an empty host is 127.0.0.1; port 0 picks a free one), or
    ``ValueError`` saying why."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected HOST:PORT with a port in 0..65535, e.g. 127.0.0.1:8000")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host``: 127.0.0.0/8, ::1 or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def exposure_problem(address: str, authenticated: bool, insecure: bool) -> str | None:
    """Why ``--http address`` must not start as configured, or ``None``."""
    try:
        host, _ = split_host_port(address)
    except ValueError as exc:
        return f"--http {address}: {exc}"
    if authenticated or insecure or is_loopback(host):
        return None
    return (
        f"refusing to serve HTTP on {address} without authentication: give --tenants with API keys "
        "(`mlx-batchd keys new-api NAME`), bind a loopback address (127.0.0.1), or pass --insecure to "
        "serve anyone who can connect"
    )


def metrics_exposure_problem(address: str, insecure: bool) -> str | None:
    """Why ``--metrics address`` must not start as configured, or ``None``: the exposition has no
    keys, and names every tenant with its outcomes and token counts."""
    host = address.rpartition(":")[0].strip("[]") or "127.0.0.1"
    if insecure or is_loopback(host):
        return None
    return (
        f"refusing to serve metrics on {address}: they show every tenant's counters to anyone who can "
        "connect; bind a loopback address (127.0.0.1:PORT) and scrape through a proxy, or pass --insecure"
    )


class LocalUserOnly:
    """An ASGI wrapper that serves only the daemon's own user (and root) while ``applies()``: a
    request carrying ``key`` (``Authorization: Bearer`` or ``X-Api-Key``) passes; else, with
    ``check_uid``, one whose peer socket belongs to such a uid (``peer_uid``); anything else gets
    403 ``forbidden`` (the uid could not be told, or it is another user's)."""

    def __init__(self, app: ASGIApp, applies: Callable[[], bool], key: str, key_path: Path, check_uid: bool) -> None:
        self.app, self._applies, self._key, self._check_uid = app, applies, key, check_uid
        self._own = {os.geteuid(), 0}
        self._refusal = JSONResponse(
            {
                "error": {
                    "message": f"local HTTP serves only the daemon's own user: send the key in {key_path} as "
                    "`Authorization: Bearer KEY` (or start the daemon with --tenants, or --insecure)",
                    "type": "permission_error",
                    "param": None,
                    "code": "forbidden",
                }
            },
            status_code=403,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._applies() or await self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await self._refusal(scope, receive, send)

    async def _allowed(self, scope: Scope) -> bool:
        key = presented_key(Headers(scope=scope))
        if key is not None and secrets.compare_digest(key.encode(), self._key.encode()):
            return True
        client, server = scope.get("client"), scope.get("server")
        if not self._check_uid or client is None or server is None or server[1] is None:
            return False
        uid = await anyio.to_thread.run_sync(peer_uid, (client[0], client[1]), (server[0], server[1]))
        return uid is not None and uid in self._own
