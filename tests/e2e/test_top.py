"""``mlx-batchd top``: one frame from a real daemon, and every command that needs a daemon when none
answers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from clients import Client
from scheduler.cli import build_parser, top_view
from tests.conftest import start_daemon, wait_for_verdict
from tests.helpers.stats import _row


def test_top_once_against_a_daemon(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = start_daemon(tiny_model, tmp_path, "--draft", "prompt-lookup", "-k", "2", "--prefix-cache-mb", "16")
    try:
        with Client(daemon.address, timeout=120) as c:
            verdict = wait_for_verdict(c)
            result = c.generate(tokens=[5, 6, 7, 5, 6, 7], max_tokens=6)
            assert result.finish_reason in ("length", "stop")
            [pairing] = c.stats()["engine"]["verdicts"]
            shared = [(7 * i + 3) % 250 + 4 for i in range(40)]  # a prefix the cache serves the second time
            reasons = [result.finish_reason] + [
                c.generate(tokens=shared + tail, max_tokens=2).finish_reason for tail in ([11], [12])
            ]
            cache = c.stats()["engine"]["prefix_cache"]
            assert cache["serving"] and cache["hit_tokens"] >= 16, cache
        capsys.readouterr()
        args = build_parser().parse_args(["top", "--addr", daemon.address, "--once", "--timeout", "60"])
        assert args.func(args) == 0
        frame = capsys.readouterr().out
    finally:
        assert daemon.stop() == 0
    assert _row(frame, "requests completed")[1] == "3"
    assert _row(frame, "state")[1] == "serving"
    assert _row(frame, "hit rate")[1] == f"{cache['hit_rate'] * 100:.1f} %"
    assert _row(frame, "tokens from the cache")[1] == f"{cache['hit_tokens']} of {cache['lookup_tokens']}"
    assert _row(frame, "bytes")[1] == f"{cache['bytes'] / 2**20:.1f} / 16.0 MiB" and cache["bytes"] > 0
    assert _row(frame, "requests in flight")[1] == "0"
    row = _row(frame, pairing)
    assert row[1] == verdict["level"]
    assert row[2] == ("exact" if verdict["exact"] else "inexact")
    assert _row(frame, "local")[2] == "3"  # the default tenant's requests
    for reason in set(reasons):
        assert _row(frame, reason)[1] == str(reasons.count(reason))
    assert _row(frame, "drafter")[1].startswith("prompt-lookup k=2")
    # One frame, no previous snapshot: rates cannot be known yet.
    assert _row(frame, "tokens/s total")[1] == top_view.MISSING


@pytest.mark.parametrize(
    "command",
    [["top", "--once", "--timeout"], ["stats", "--timeout"], ["generate", "def f(x):", "--connect-timeout"]],
    ids=["top", "stats", "generate"],
)
def test_unreachable_daemon_is_one_line_and_exit_1(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No traceback and no endless wait: every command that needs a daemon says it is not there (a
    socket file nobody listens on; a missing file is refused before any wait, see test_cli_errors)."""
    sock = tmp_path / "nobody.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
    address = f"ipc://{sock}"
    args = build_parser().parse_args([*command, "0.5", "--addr", address])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert err == f"mlx-batchd {command[0]}: no reply from {address} within 0.5s (is the daemon running?)\n"
