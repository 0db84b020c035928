"""``mlx-batchd keys``: credentials for tenants and the daemon, made locally.

``keys new`` writes a CURVE key pair for the ZeroMQ door; ``keys new-api`` prints an HTTP API key
once with the hash the tenants file keeps. Neither needs a daemon, and neither imports MLX.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from scheduler.cli.errors import CommandError, local_command
from scheduler.cli.options import Parser


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``keys new`` and ``keys new-api``."""
    p = sub.add_parser("keys", help="CURVE keys for tenants and the daemon")
    keys = p.add_subparsers(dest="keys_command", required=True)
    k = keys.add_parser("new", help="write NAME.key (public) and NAME.key_secret")
    k.add_argument("name")
    k.add_argument("--dir", default=".")
    k.add_argument("--force", action="store_true", help="replace an existing pair of that name")
    k.set_defaults(func=local_command("keys", new_pair))
    k = keys.add_parser("new-api", help="print a fresh HTTP API key once, and the tenants.toml line with its hash")
    k.add_argument("name", help="the tenant the key is for")
    k.set_defaults(func=local_command("keys", new_api))


def new_pair(args: argparse.Namespace) -> int:
    """``keys new NAME``: a CURVE keypair as pyzmq certificate files (NAME.key, NAME.key_secret).
    An existing pair is kept unless ``--force``: replacing the server's pair locks out every client
    that holds the old public key."""
    import zmq.auth

    name = args.name
    if not name or Path(name).name != name or name in (".", ".."):
        raise CommandError(f"NAME {name!r} must be a plain file name (use --dir for the folder)")
    directory = Path(args.dir)
    existing = [p for p in (directory / f"{name}.key", directory / f"{name}.key_secret") if p.exists()]
    if existing and not args.force:
        raise CommandError(
            f"{existing[0]} already exists; replacing it locks out whoever holds the old public key "
            "(pass --force to replace it anyway)"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        public, secret = zmq.auth.create_certificates(str(directory), name)
        Path(secret).chmod(0o600)
    except OSError as exc:
        raise CommandError(f"cannot write keys to {directory}: {exc.strerror or exc}") from None
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def new_api(args: argparse.Namespace) -> int:
    """``keys new-api NAME``: a fresh HTTP API key, printed once, and the tenants.toml line holding its
    hash. The key itself is stored nowhere: whoever loses it makes a new one."""
    from scheduler.http_auth import key_digest, new_api_key

    name = args.name
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise CommandError(f"NAME {name!r} must be a tenant name of letters, digits, '_' and '-'")
    key = new_api_key()
    print(f"API key for tenant {name} (shown only now; give it to its user, keep it secret):")
    print(f"  {key}")
    print(f"Add its hash to [tenants.{name}] in the tenants file, then reload (kill -HUP) or restart:")
    print(f'  api_keys_sha256 = ["{key_digest(key)}"]')
    return 0
