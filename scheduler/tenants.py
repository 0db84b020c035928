"""Tenants: who may use the daemon, with which keys, and within which limits.

A tenants file is TOML, one table per tenant::

    [tenants.alice]
    keys = ["keys/alice.key"]     # CURVE public key files (relative to this file) or Z85 strings
    api_keys_sha256 = ["..."]     # SHA-256 hex digests of HTTP API keys (`mlx-batchd keys new-api NAME`)
    weight = 1.0                  # share of the decode slots under contention
    priority_ceiling = 0          # highest `priority` a request may ask for
    max_concurrent = 8            # sequences decoding at once
    max_queued = 64               # requests waiting for a slot (default 256)
    max_prompt_tokens = 4096
    max_new_tokens = 1024         # per request
    token_rate = 0.0              # prompt + generated tokens per second, 0 = unlimited
    token_burst = 0               # bucket size; 0 = 10 seconds' worth
    admin = false                 # may see every tenant's usage and ask for operator-only work
    share_prefix_cache = false    # reuse cached prompt prefixes with other tenants marked so

Without a file every request belongs to the single tenant ``local``, the local operator. The file
is re-read on SIGHUP: new keys and limits apply to new requests, and revoked keys are refused from
then on. A tenant needs at least one CURVE key or API key hash; the file holds only hashes of API
keys, so reading it never reveals a key. Every number is range-checked (NaN and infinities
included), so a typo cannot make every fair-share comparison false or a limit unbounded.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCAL = "local"
_UNLIMITED = 1 << 62
#: Requests a tenant of a tenants file may have waiting for a slot when its table does not say: a
#: share of the daemon's queue (``--max-queued``, default 1024), so no tenant fills it by default.
DEFAULT_TENANT_MAX_QUEUED = 256

_FIELDS: dict[str, type | tuple[type, ...]] = {
    "keys": list,
    "api_keys_sha256": list,
    "weight": (int, float),
    "priority_ceiling": int,
    "max_concurrent": int,
    "max_queued": int,
    "max_prompt_tokens": int,
    "max_new_tokens": int,
    "token_rate": (int, float),
    "token_burst": (int, float),
    "admin": bool,
    "share_prefix_cache": bool,
}

#: Inclusive bounds of each number, and whether its lower bound is excluded (weight must be > 0).
_RANGES: dict[str, tuple[float, float, bool]] = {
    "weight": (0.0, 1e6, True),
    "priority_ceiling": (-1000, 1000, False),
    "max_concurrent": (1, _UNLIMITED, False),
    "max_queued": (1, _UNLIMITED, False),
    "max_prompt_tokens": (1, _UNLIMITED, False),
    "max_new_tokens": (1, _UNLIMITED, False),
    "token_rate": (0.0, 1e12, False),
    "token_burst": (0.0, 1e15, False),
}


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class TenantsError(ValueError):
    """A tenants file that cannot be used, with what to fix."""


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: frozenset[str] = frozenset()  # Z85 public keys
    #: SHA-256 hex digests of the tenant's HTTP API keys (lowercase).
    api_key_hashes: frozenset[str] = frozenset()
    weight: float = 1.0
    priority_ceiling: int = 0
    max_concurrent: int = _UNLIMITED
    max_queued: int = _UNLIMITED
    max_prompt_tokens: int = _UNLIMITED
    max_new_tokens: int = _UNLIMITED
    token_rate: float = 0.0
    token_burst: float = 0.0
    #: Sees every tenant's usage in ``stats`` and in the HTTP door's ``/metrics``.
    admin: bool = False
    #: Its prompts' cached prefixes are shared with every other tenant marked so (a shared system
    #: prompt); otherwise a tenant only ever reuses prefixes it created itself.
    share_prefix_cache: bool = False


@dataclass
class TenantTable:
    tenants: dict[str, Tenant] = field(default_factory=dict)
    source: Path | None = None

    @property
    def authenticated(self) -> bool:
        """Whether requests are tied to CURVE keys (a tenants file is in force)."""
        return self.source is not None

    def is_operator(self, tenant: Tenant) -> bool:
        """The local operator (no tenants file: whoever can reach the private socket) or an admin."""
        return not self.authenticated or tenant.admin

    def by_key(self, z85_key: str) -> Tenant | None:
        for tenant in self.tenants.values():
            if z85_key in tenant.keys:
                return tenant
        return None

    def by_api_key_hash(self, digest: str) -> Tenant | None:
        """The tenant holding this SHA-256 hex digest of an HTTP API key."""
        for tenant in self.tenants.values():
            if digest in tenant.api_key_hashes:
                return tenant
        return None


def local_table() -> TenantTable:
    return TenantTable({LOCAL: Tenant(LOCAL)})


def _read_key(entry: object, base: Path, where: str) -> str:
    """A Z85 public key, given as such (40 characters) or as a certificate file."""
    if not isinstance(entry, str):
        raise TenantsError(f"{where}.keys holds {entry!r}; give key file paths or Z85 strings")
    if len(entry) == 40 and not (base / entry).exists():
        return entry
    import zmq.auth

    path = (base / entry).expanduser()
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise TenantsError(f"{where}: cannot read key {entry!r} ({path}): {exc}") from None
    return public.decode("ascii")


def _check_number(where: str, key: str, value: int | float) -> None:
    """Finite and inside the field's range, or a ``TenantsError`` naming file, tenant and field."""
    low, high, open_low = _RANGES[key]
    below = value <= low if open_low else value < low
    if not math.isfinite(value) or below or value > high:
        bracket = "(" if open_low else "["
        raise TenantsError(f"{where}.{key} = {value!r} must be a finite number in {bracket}{low:g}, {high:g}]")


def _tenant(name: str, spec: Any, path: Path) -> Tenant:
    where = f"{path}: [tenants.{name}]"
    if not isinstance(spec, dict):
        raise TenantsError(f"{where} must be a table")
    unknown = set(spec) - set(_FIELDS)
    if unknown:
        raise TenantsError(f"{where}: unknown fields {sorted(unknown)}; known: {sorted(_FIELDS)}")
    for key, kind in _FIELDS.items():
        if key not in spec:
            continue
        wrong_bool = isinstance(spec[key], bool) != (kind is bool)
        if not isinstance(spec[key], kind) or wrong_bool:
            raise TenantsError(f"{where}.{key} has the wrong type ({type(spec[key]).__name__})")
        if key in _RANGES:
            _check_number(where, key, spec[key])
    keys = frozenset(_read_key(k, path.parent, where) for k in spec.get("keys", []))
    hashes = frozenset(_api_key_hash(h, where) for h in spec.get("api_keys_sha256", []))
    if not keys and not hashes:
        raise TenantsError(
            f"{where} needs at least one key: a CURVE key in `keys` or an API key hash in `api_keys_sha256`"
        )
    values: dict[str, Any] = {"max_queued": DEFAULT_TENANT_MAX_QUEUED}
    values.update({k: v for k, v in spec.items() if k not in ("keys", "api_keys_sha256")})
    return Tenant(name=name, keys=keys, api_key_hashes=hashes, **values)


def _api_key_hash(entry: object, where: str) -> str:
    """A SHA-256 hex digest (64 hex digits). A key pasted where its hash belongs is refused, so a key
    never sits in the file by mistake."""
    if not isinstance(entry, str) or not _SHA256_HEX.fullmatch(entry.lower()):
        shown = "a string" if isinstance(entry, str) else repr(entry)
        raise TenantsError(
            f"{where}.api_keys_sha256 holds {shown} that is not a SHA-256 hex digest (64 hex digits); "
            "paste the line `mlx-batchd keys new-api NAME` prints, never the key itself"
        )
    return entry.lower()


def load_tenants(path: Path) -> TenantTable:
    """Parse and check a tenants file; every key belongs to exactly one tenant."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TenantsError(f"cannot read tenants file {path}: {exc}") from None
    section = data.get("tenants")
    if not isinstance(section, dict) or not section:
        raise TenantsError(f"{path}: expected one or more [tenants.NAME] tables")
    tenants = {name: _tenant(name, spec, path) for name, spec in section.items()}
    owners: dict[str, str] = {}
    for t in tenants.values():
        for k in (*t.keys, *t.api_key_hashes):
            if k in owners:
                raise TenantsError(f"{path}: key {k[:8]}... belongs to both {owners[k]!r} and {t.name!r}")
            owners[k] = t.name
    return TenantTable(tenants, source=path)
