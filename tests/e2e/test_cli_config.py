"""The configuration surface through the installed ``mlx-batchd`` command, in subprocesses:
``--version``, ``serve --help`` with every default, ``serve --config FILE.toml`` taking effect in a
running daemon (a command-line option winning over the file), and a bad file refused in one line,
exit 2, before anything is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from clients import Client
from tests.conftest import TEST_CONTEXT, start_daemon

#: The console script pip installed beside this interpreter (``python -m scheduler`` where there is none).
SCRIPT = Path(sys.executable).with_name("mlx-batchd")
COMMAND = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-m", "scheduler"]


def mlx_batchd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MLX_BATCHD_ADDR"}
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=120, env=env)


def test_version_names_the_package_mlx_and_mlx_lm() -> None:
    out = mlx_batchd("--version")
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout == f"mlx-batchd {version('mlx-batchd')} (mlx {version('mlx')}, mlx-lm {version('mlx-lm')})\n"


def test_serve_help_shows_every_default_and_points_to_the_file() -> None:
    out = mlx_batchd("serve", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for shown in ("--max-batch MAX_BATCH most sequences decoded together (default: 32)", "(default: info)"):
        assert shown in text, text
    assert "--config FILE.toml" in text and "docs/configuration.md" in text
    options = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  -")]
    assert len(options) <= 23 and "--admit-window-ms" not in text, options  # the rest are keys of the file


@pytest.mark.parametrize(
    ("toml", "line"),
    [
        (
            "max_btach = 8\n",
            "unknown key 'max_btach' (did you mean 'max_batch'? docs/configuration.md lists every key)",
        ),
        ('admit_window_ms = "20"\n', "admit_window_ms: expected a number, got string '20'"),
        ("max_batch = 0\n", "max_batch: must be an integer >= 1, got 0"),
    ],
    ids=["unknown key", "wrong type", "out of range"],
)
def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path: Path, toml: str, line: str) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(toml)
    out = mlx_batchd("serve", "--config", str(path), "--listen", f"ipc://{tmp_path / 'd.sock'}")
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    assert out.stderr == f"mlx-batchd serve: {path}: {line}\n"
    assert not (tmp_path / "d.sock").exists()


def test_a_config_file_takes_effect_and_the_command_line_wins(tiny_model: Path, tmp_path: Path) -> None:
    """The daemon's health reports its limits: the file sets ``default_max_tokens`` and the
    file-only ``max_frame_bytes``; ``--max-tokens-cap`` given on the command line (at its default
    value, even) wins over the file's."""
    config = tmp_path / "serve.toml"
    config.write_text("max_tokens_cap = 100\ndefault_max_tokens = 17\nmax_frame_bytes = 65536\nlog_level = 'warning'\n")
    daemon = start_daemon(
        tiny_model,
        tmp_path / "d",
        "--config",
        str(config),
        "--max-tokens-cap",
        "4096",
        "--context-length",
        str(TEST_CONTEXT),
    )
    try:
        with Client(daemon.address) as client:
            limits = client.health()["limits"]
        assert limits == {"max_tokens": 4096, "default_max_tokens": 17, "max_frame_bytes": 65536}
    finally:
        assert daemon.stop() == 0, daemon.log()
    # log_level = 'warning': no INFO line of the front end ("ready", "received SIGTERM") or the engine.
    assert " INFO " not in daemon.log() and "mlx-batchd ready" in daemon.log(), daemon.log()
