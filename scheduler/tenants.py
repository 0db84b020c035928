"""Tenants: who may use the daemon, with which keys, and within which limits.

A tenants file is TOML, one table per tenant::

    [tenants.alice]
    keys = ["keys/alice.key"]     # CURVE public key files (relative to this file) or Z85 strings
    weight = 1.0                  # share of the decode slots under contention
    priority_ceiling = 0          # highest `priority` a request may ask for
    max_concurrent = 8            # sequences decoding at once
    max_queued = 64               # requests waiting for a slot
    max_prompt_tokens = 4096
    max_new_tokens = 1024         # per request
    token_rate = 0.0              # prompt + generated tokens per second, 0 = unlimited
    token_burst = 0               # bucket size; 0 = 10 seconds' worth

Without a file every request belongs to the single tenant ``local``. The file is re-read on SIGHUP:
new keys and limits apply to new requests, and revoked keys are refused from then on.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCAL = "local"
_UNLIMITED = 1 << 62

_FIELDS: dict[str, type | tuple[type, ...]] = {
    "keys": list,
    "weight": (int, float),
    "priority_ceiling": int,
    "max_concurrent": int,
    "max_queued": int,
    "max_prompt_tokens": int,
    "max_new_tokens": int,
    "token_rate": (int, float),
    "token_burst": (int, float),
}


class TenantsError(ValueError):
    """A tenants file that cannot be used, with what to fix."""


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: frozenset[str] = frozenset()  # Z85 public keys
    weight: float = 1.0
    priority_ceiling: int = 0
    max_concurrent: int = _UNLIMITED
    max_queued: int = _UNLIMITED
    max_prompt_tokens: int = _UNLIMITED
    max_new_tokens: int = _UNLIMITED
    token_rate: float = 0.0
    token_burst: float = 0.0


@dataclass
class TenantTable:
    tenants: dict[str, Tenant] = field(default_factory=dict)
    source: Path | None = None

    @property
    def authenticated(self) -> bool:
        """Whether requests are tied to CURVE keys (a tenants file is in force)."""
        return self.source is not None

    def by_key(self, z85_key: str) -> Tenant | None:
        for tenant in self.tenants.values():
            if z85_key in tenant.keys:
                return tenant
        return None


def local_table() -> TenantTable:
    return TenantTable({LOCAL: Tenant(LOCAL)})


def _read_key(entry: str, base: Path) -> str:
    """A Z85 public key, given as such (40 characters) or as a certificate file."""
    if len(entry) == 40 and not (base / entry).exists():
        return entry
    import zmq.auth

    path = (base / entry).expanduser()
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise TenantsError(f"cannot read key {entry!r} ({path}): {exc}") from None
    return public.decode("ascii")


def _tenant(name: str, spec: Any, base: Path) -> Tenant:
    if not isinstance(spec, dict):
        raise TenantsError(f"[tenants.{name}] must be a table")
    unknown = set(spec) - set(_FIELDS)
    if unknown:
        raise TenantsError(f"[tenants.{name}]: unknown fields {sorted(unknown)}; known: {sorted(_FIELDS)}")
    for key, kind in _FIELDS.items():
        if key in spec and (not isinstance(spec[key], kind) or isinstance(spec[key], bool)):
            raise TenantsError(f"[tenants.{name}].{key} has the wrong type ({type(spec[key]).__name__})")
    keys = frozenset(_read_key(k, base) for k in spec.get("keys", []))
    if not keys:
        raise TenantsError(f"[tenants.{name}] needs at least one key in `keys`")
    values = {k: v for k, v in spec.items() if k != "keys"}
    for key in ("weight",):
        if key in values and values[key] <= 0:
            raise TenantsError(f"[tenants.{name}].{key} must be > 0")
    for key in ("max_concurrent", "max_queued", "max_prompt_tokens", "max_new_tokens"):
        if key in values and values[key] < 1:
            raise TenantsError(f"[tenants.{name}].{key} must be >= 1")
    return Tenant(name=name, keys=keys, **values)


def load_tenants(path: Path) -> TenantTable:
    """Parse and check a tenants file; every key belongs to exactly one tenant."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TenantsError(f"cannot read tenants file {path}: {exc}") from None
    section = data.get("tenants")
    if not isinstance(section, dict) or not section:
        raise TenantsError(f"{path}: expected one or more [tenants.NAME] tables")
    tenants = {name: _tenant(name, spec, path.parent) for name, spec in section.items()}
    owners: dict[str, str] = {}
    for t in tenants.values():
        for k in t.keys:
            if k in owners:
                raise TenantsError(f"key {k[:8]}... belongs to both {owners[k]!r} and {t.name!r}")
            owners[k] = t.name
    return TenantTable(tenants, source=path)
