"""Who an HTTP request is: API keys, their hashes in tenants.toml, and who may be served without one.

A key travels as ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``. The tenants file holds only
SHA-256 digests of keys (``api_keys_sha256``), so a copy of the file gives nobody a key; keys are long
random strings, so an unsalted digest cannot be searched for. Without a tenants file every request
belongs to the tenant ``local`` (the operator) and keys are ignored, which is safe only where nobody
else can connect: a non-loopback address is refused then, unless ``--insecure``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from collections.abc import Mapping

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
