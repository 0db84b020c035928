"""Daemons for the e2e test modules: stopped cleanly after their module, with the HTTP door on a free
port, and with tenants (API keys) where a test needs them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from clients.sync import Client
from tests.conftest import TEST_CONTEXT, Daemon, start_daemon


def serve_http(model: Path | str, workdir: Path, *extra: str, client_kwargs: dict[str, str] | None = None) -> Daemon:
    """``start_daemon`` with the HTTP door on a free port (``http_url`` reads it from the log)."""
    return start_daemon(model, workdir, "--http", "127.0.0.1:0", *extra, client_kwargs=client_kwargs)


def served(daemon: Daemon) -> Iterator[Daemon]:
    """The body of a module's daemon fixture (``yield from served(...)``): the daemon for the
    module, then stopped, and it must exit 0."""
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def serve_once(daemon: Daemon) -> str:
    """One 4-token request through ``daemon``, then its stop: it must answer in full and exit 0. Its log."""
    try:
        with Client(daemon.address, timeout=120) as client:
            result = client.generate(tokens=[1, 2, 3], max_tokens=4)
        assert len(result.tokens) == 4, daemon.log()
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()
    return daemon.log()


def tenants_daemon(model: Path | str, keys: Path, workdir: Path, *extra: str) -> Daemon:
    """A daemon with the HTTP door and tenants: ``keys`` holds ``tenants.toml``, the daemon's CURVE
    secret (``server.key_secret``) and the operator's keys (``ops.key*``), which its own client uses."""
    return serve_http(
        model,
        workdir,
        "--context-length",
        str(TEST_CONTEXT),
        "--tenants",
        str(keys / "tenants.toml"),
        "--curve-secret",
        str(keys / "server.key_secret"),
        *extra,
        client_kwargs={"curve_secret": str(keys / "ops.key_secret"), "server_key": str(keys / "server.key")},
    )
