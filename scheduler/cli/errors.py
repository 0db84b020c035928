"""One-line errors: the checks a command makes before it starts, and the two wrappers that turn a
failure the user can act on into one line on stderr and an exit code.

A user mistake never ends in a traceback or a silent wait. What only shows when a command runs (a
path that is not a model, an address without ``ipc://``, a key file that is not there, no daemon at
the address) is one line naming the problem and the fix, exit 1; Ctrl-C is exit 130. Every command
is wrapped by ``daemon_command`` or ``local_command``, so that rule lives here and nowhere else.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from clients import envs
from clients.address import IPC_PREFIX, default_address, ipc_path

Command = Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A failure the user can act on (a bad address, a missing file, no daemon): its message names
    the problem and the fix, and the command prints it as one line and exits 1."""


# ---------------------------------------------------------------------------------------------- checks


def address_and_source(given: str | None, option: str) -> tuple[str, str]:
    """The address a command will use and where it came from, for messages."""
    if given:
        return given, option
    if envs.addr():
        return default_address(), envs.ADDR
    return default_address(), "the default address"


def check_address(address: str, source: str) -> None:
    """Refuse an address that is not ``ipc://PATH`` or ``tcp://HOST:PORT``: ZeroMQ answers those
    with a bare ``Invalid argument`` traceback, and a plain path is the usual slip, so the message
    spells out the address that was probably meant."""
    if address.startswith(IPC_PREFIX):
        if len(address) == len(IPC_PREFIX):
            raise CommandError(f"{source} {address!r} names no socket file; write ipc:///PATH/TO/daemon.sock")
        return
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://") :].rpartition(":")
        if host and sep and port.isdigit() and 0 < int(port) < 65536:
            return
        raise CommandError(f"{source} {address!r}: a tcp address needs a host and a port, e.g. tcp://127.0.0.1:5555")
    looks_tcp = re.fullmatch(r"[\w.\-\[\]:*]+:\d+", address) is not None
    fix = f"tcp://{address}" if looks_tcp else f"{IPC_PREFIX}{Path(address).expanduser().absolute()}"
    raise CommandError(
        f"{source} {address!r} is not a ZeroMQ address; did you mean {fix}? (addresses start with ipc:// or tcp://)"
    )


def check_key_file(path: str, option: str, secret: bool) -> None:
    """A CURVE key file that exists and holds what ``option`` needs; pyzmq itself reports a
    missing file as an "Invalid certificate file"."""
    import zmq.auth

    if not Path(path).is_file():
        raise CommandError(f"{option} {path}: no such file (make a key pair with `mlx-batchd keys new NAME`)")
    try:
        _, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CommandError(f"{option} {path} is not a CURVE key file ({exc})") from None
    if secret and secret_key is None:
        raise CommandError(f"{option} {path} holds only a public key; give the NAME.key_secret file")


def check_client_keys(args: argparse.Namespace) -> None:
    """``--curve-secret`` and ``--server-key``: both or neither, each a readable key file."""
    secret, server = getattr(args, "curve_secret", None), getattr(args, "server_key", None)
    if (secret is None) != (server is None):
        raise CommandError(
            "give both --curve-secret (your NAME.key_secret) and --server-key (the daemon's public key), or neither"
        )
    if secret is not None and server is not None:
        check_key_file(secret, "--curve-secret", secret=True)
        check_key_file(server, "--server-key", secret=False)


def check_socket(address: str) -> None:
    """An ``ipc://`` address whose socket file is missing has no daemon behind it: say so at once,
    instead of letting ZeroMQ wait for one to appear."""
    path = ipc_path(address)
    if path is None:
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CommandError(
            f"no daemon at {address} (the socket file does not exist); start one with `mlx-batchd serve`"
        ) from None
    except OSError as exc:
        raise CommandError(f"cannot use {address}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise CommandError(f"{address}: {path} is not a socket; is --addr the daemon's --listen address?")


def unreachable(address: str, wait: float | None, keys: bool) -> str:
    """Why no reply came, with the likely causes for this kind of address and keys."""
    within = f" within {wait:g}s" if wait else ""
    if address.startswith("tcp://") and not keys:
        why = "is the daemon running? one with tenants also needs --curve-secret and --server-key"
    elif keys:
        why = "is the daemon running, and is --server-key its public key?"
    else:
        why = "is the daemon running?"
    return f"no reply from {address}{within} ({why})"


def _request_error_line(address: str, exc: Exception) -> str:
    """A ``RequestError`` with the fix where the code has an obvious one."""
    line = f"{address}: {exc}"
    if getattr(exc, "code", None) == "unauthorized":
        line += " (check that --server-key is the daemon's public key and your public key is in its tenants file)"
    return line


# ---------------------------------------------------------------------------------------------- wrappers


def daemon_command(name: str, func: Command) -> Command:
    """Wrap a subcommand that talks to a running daemon: a bad address or key file, a missing
    socket, an unreachable daemon or a client-side error becomes one line on stderr and exit 1
    instead of a traceback or a wait, and Ctrl-C exits 130."""
    import zmq

    from clients import ClientError

    def run(args: argparse.Namespace) -> int:
        address, source = address_and_source(getattr(args, "addr", None), "--addr")
        keys = getattr(args, "curve_secret", None) is not None
        try:
            check_address(address, source)
            check_client_keys(args)
            check_socket(address)
            return func(args)
        except KeyboardInterrupt:
            return 130
        except CommandError as exc:
            return _fail(name, str(exc))
        except TimeoutError:
            return _fail(name, unreachable(address, getattr(args, "timeout", None), keys))
        except ClientError as exc:
            return _fail(name, _request_error_line(address, exc))
        except zmq.ZMQError as exc:
            return _fail(name, f"{address}: {exc}")

    return run


#: Exceptions whose message is written for the user, with the exit code: 1 for what is missing or
#: does not load, 2 for a daemon configuration that is refused (the parser's code for bad options).
#: Looked up only in modules already imported, since one that was not cannot have raised: ``keys``
#: and ``demo`` never load MLX just to check an exception's type.
_USER_ERRORS = (
    ("workers.models.loading", "ModelError", 1),
    ("workers.models.gguf.reader", "GGUFError", 2),  # a GGUF file that cannot be converted
    ("workers.envs", "SettingError", 2),
    ("workers.models.synthetic", "PresetError", 1),
    ("scheduler.spawn", "DaemonExited", 1),
    ("scheduler.frontend", "BindError", 1),  # before ConfigError, its base: first match wins
    ("scheduler.frontend", "ConfigError", 2),
    ("scheduler.tenants", "TenantsError", 2),
)


def _user_error_code(exc: BaseException) -> int | None:
    for module, name, code in _USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return code
    return None


def local_command(name: str, func: Command) -> Command:
    """Wrap a subcommand that works on local things (serve, probe, synth, keys, bench, demo): a
    model path that is not a model, an unknown preset, a bad address or key file becomes one line on
    stderr and exit 1 (2 for a configuration the daemon refuses); Ctrl-C exits 130."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except KeyboardInterrupt:
            return 130
        except CommandError as exc:
            return _fail(name, str(exc))
        except Exception as exc:
            code = _user_error_code(exc)
            if code is None:
                raise
            return _fail(name, str(exc), code)

    return run


def _fail(name: str, message: str, code: int = 1) -> int:
    print(f"mlx-batchd {name}: {' '.join(message.split())}", file=sys.stderr)
    return code
