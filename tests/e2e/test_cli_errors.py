"""Day-one mistakes on the command line: one line that names the problem and the fix, never a
traceback and never a wait. Each case runs the real command (``python -m scheduler``) in a
subprocess, as a user would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from clients.protocol import MsgType, pack, unpack
from scheduler.cli import build_parser
from tests.conftest import start_daemon


@dataclass
class Run:
    code: int
    out: str
    err: str
    seconds: float


def mlx_batchd(
    *args: str, cwd: Path | None = None, timeout: float = 120, env_extra: dict[str, str] | None = None
) -> Run:
    env = {k: v for k, v in os.environ.items() if k != "MLX_BATCHD_ADDR"} | (env_extra or {})
    tic = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "scheduler", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )
    return Run(p.returncode, p.stdout, p.stderr, time.monotonic() - tic)


def assert_one_line(run: Run, code: int, *needles: str) -> None:
    """Exit ``code``, exactly one line on stderr holding every needle, nothing on stdout."""
    assert "Traceback" not in run.err, run.err
    assert run.code == code, run.err
    assert run.err.endswith("\n") and run.err.count("\n") == 1, run.err
    assert run.out == "", run.out
    for needle in needles:
        assert needle in run.err, run.err


# ---------------------------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A path that does not exist, a folder that is not a model, and a model of an architecture
    mlx-lm does not know (config and weights file present)."""
    root = tmp_path_factory.mktemp("bad-models")
    (root / "plain").mkdir()
    (root / "plain" / "notes.txt").write_text("not a model\n")
    unknown = root / "unknown-arch"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_architecture", "vocab_size": 8}))
    (unknown / "model.safetensors").write_bytes(b"")
    return {"missing": root / "nope", "plain": root / "plain", "unknown": unknown}


def test_a_model_whose_weights_do_not_load_is_one_line(tiny_model: Path, tmp_path: Path) -> None:
    """A cut download: the config is fine, the weights file is not."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    run = mlx_batchd("probe", "--model", str(broken), "--no-store")
    assert_one_line(run, 1, "mlx-batchd probe: --model", "cannot be loaded", "model.safetensors")


MODEL_CASES = {
    "missing": ("is not a model directory", "does not exist", "'demo'"),
    "plain": ("is not a model directory", "no config.json", "'demo'"),
    "unknown": ("no_such_architecture", "pip install -U mlx-lm"),
}


@pytest.mark.parametrize("kind", MODEL_CASES)
@pytest.mark.parametrize("command", ["serve", "probe"])
def test_a_model_that_cannot_load_is_one_line(
    command: str, kind: str, bad_models: dict[str, Path], tmp_path: Path
) -> None:
    extra = ["--listen", f"ipc://{tmp_path / 'd.sock'}"] if command == "serve" else ["--no-store"]
    run = mlx_batchd(command, "--model", str(bad_models[kind]), *extra)
    assert_one_line(run, 1, f"mlx-batchd {command}: --model", *MODEL_CASES[kind])
    assert not (tmp_path / "d.sock").exists()  # refused before the socket was bound


def test_a_draft_model_that_cannot_load_is_one_line(
    bad_models: dict[str, Path], tiny_model: Path, tmp_path: Path
) -> None:
    run = mlx_batchd(
        "serve", "--model", str(tiny_model), "--draft", str(bad_models["plain"]), "--listen", f"ipc://{tmp_path / 's'}"
    )
    assert_one_line(run, 1, "--draft", "is not a model directory")


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("MLX_BATCHD_COMPILED_LAYERS", "yes", "expected 0 or 1"),
        ("MLX_BATCHD_FASTPATH", "fast", "expected off, generic or cuda"),
        ("MLX_BATCHD_ROWKERNEL", "gpu", "expected off, reference or cuda"),
        ("MLX_BATCHD_BENCH_PROCESS_PIN", "true", "expected 0 or 1"),
    ],
)
def test_a_kernel_setting_that_is_not_one_of_its_values_is_one_line(
    tiny_model: Path, tmp_path: Path, name: str, value: str, expected: str
) -> None:
    """An operator's typo in an ``MLX_BATCHD_*`` kernel setting is refused before the socket is bound,
    in one line naming the variable and its values (the engine would read it only at its first forward)."""
    run = mlx_batchd(
        "serve", "--model", str(tiny_model), "--listen", f"ipc://{tmp_path / 'd.sock'}", env_extra={name: value}
    )
    assert_one_line(run, 2, f"mlx-batchd serve: {name}={value!r}", expected)
    assert not (tmp_path / "d.sock").exists()


def test_unknown_synth_preset_lists_the_known_ones(tmp_path: Path) -> None:
    run = mlx_batchd("synth", "--preset", "nope", "--out", str(tmp_path / "m"))
    assert_one_line(run, 1, "mlx-batchd synth: unknown preset 'nope'", "tiny-llama")


# ---------------------------------------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    "command",
    [["serve", "--listen"], ["generate", "hi", "--addr"], ["stats", "--addr"], ["top", "--once", "--addr"]],
    ids=["serve", "generate", "stats", "top"],
)
def test_an_address_without_a_transport_is_one_line(command: list[str], tmp_path: Path) -> None:
    path = tmp_path / "x.sock"
    run = mlx_batchd(*command, str(path))
    assert_one_line(run, 1, "is not a ZeroMQ address", f"ipc://{path}")


@pytest.mark.parametrize(
    "command",
    [["generate", "hi", "--connect-timeout", "60"], ["stats", "--timeout", "60"], ["top", "--once", "--timeout", "60"]],
    ids=["generate", "stats", "top"],
)
def test_a_missing_ipc_socket_fails_at_once(command: list[str], tmp_path: Path) -> None:
    address = f"ipc://{tmp_path / 'nobody.sock'}"
    run = mlx_batchd(*command, "--addr", address)
    assert_one_line(run, 1, f"no daemon at {address}", "mlx-batchd serve")
    assert run.seconds < 30  # not the 60 s the reply would have been waited for


# ---------------------------------------------------------------------------------------------- keys


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    for name in ("server", "alice", "impostor"):
        zmq.auth.create_certificates(str(d), name)
    return d


@pytest.mark.parametrize(
    "command",
    [["generate", "hi", "--addr"], ["stats", "--addr"], ["top", "--once", "--addr"]],
    ids=["generate", "stats", "top"],
)
def test_a_missing_key_file_is_named(command: list[str], keys: Path, tmp_path: Path) -> None:
    missing = tmp_path / "alice.key_secret"
    run = mlx_batchd(
        *command, "tcp://127.0.0.1:9", "--curve-secret", str(missing), "--server-key", str(keys / "server.key")
    )
    assert_one_line(run, 1, f"--curve-secret {missing}: no such file", "mlx-batchd keys new")
    assert "Invalid certificate" not in run.err


def test_serve_names_a_missing_curve_secret(tiny_model: Path, tmp_path: Path) -> None:
    missing = tmp_path / "server.key_secret"
    run = mlx_batchd(
        "serve", "--model", str(tiny_model), "--listen", "tcp://127.0.0.1:9", "--curve-secret", str(missing)
    )
    assert_one_line(run, 1, f"--curve-secret {missing}: no such file")


def test_a_public_key_given_as_the_secret_is_named(keys: Path) -> None:
    run = mlx_batchd(
        "stats",
        "--addr",
        "tcp://127.0.0.1:9",
        "--curve-secret",
        str(keys / "alice.key"),
        "--server-key",
        str(keys / "server.key"),
    )
    assert_one_line(run, 1, "holds only a public key", "key_secret")


def _free_tcp() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_wrong_server_key_over_tcp_says_unauthorized(tiny_model: Path, tmp_path: Path, keys: Path) -> None:
    """Not "is the daemon running?": the daemon is there and refused the handshake."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.alice]\nkeys = ["{keys / "alice.key"}"]\n')
    address = _free_tcp()
    creds = {"curve_secret": str(keys / "alice.key_secret"), "server_key": str(keys / "server.key")}
    d = start_daemon(
        tiny_model,
        tmp_path,
        "--tenants",
        str(tenants),
        "--curve-secret",
        str(keys / "server.key_secret"),
        address=address,
        client_kwargs=creds,
    )
    try:
        wrong = ("--curve-secret", str(keys / "alice.key_secret"), "--server-key", str(keys / "impostor.key"))
        run = mlx_batchd("generate", "hi", "--addr", address, "--connect-timeout", "10", *wrong)
        assert_one_line(run, 1, "unauthorized", "--server-key")
        assert "is the daemon running" not in run.err
    finally:
        assert d.stop() == 0


# ---------------------------------------------------------------------------------------------- keys new


def test_keys_new_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    first = mlx_batchd("keys", "new", "server", "--dir", str(tmp_path))
    assert first.code == 0, first.err
    before = (tmp_path / "server.key").read_text()
    again = mlx_batchd("keys", "new", "server", "--dir", str(tmp_path))
    assert_one_line(again, 1, "already exists", "--force")
    assert (tmp_path / "server.key").read_text() == before
    forced = mlx_batchd("keys", "new", "server", "--dir", str(tmp_path), "--force")
    assert forced.code == 0, forced.err
    assert (tmp_path / "server.key").read_text() != before
    assert oct((tmp_path / "server.key_secret").stat().st_mode)[-3:] == "600"


# ---------------------------------------------------------------------------------------------- priority


class FakeDaemon:
    """A real ROUTER socket that answers health and records what the command put on the wire.
    A submit ends at once; with ``stall``, it gets one token and then nothing, cancels included
    (a daemon that is alive on the wire but never confirms)."""

    def __init__(self, address: str, stall: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(address)
        self.stall = stall
        self.submits: list[dict[str, Any]] = []
        self.cancels: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            peer, frame = self.sock.recv_multipart()
            msg = unpack(frame)
            reply: dict[str, Any] = {"v": msg.get("v"), "id": msg["id"]}
            if msg["type"] == MsgType.HEALTH.value:
                reply.update(type=MsgType.HEALTH.value, status="ready")
            elif msg["type"] == MsgType.SUBMIT.value:
                self.submits.append(msg)
                if self.stall:
                    reply.update(type=MsgType.TOKEN.value, tokens=[1], text="abc")
                else:
                    reply.update(type=MsgType.END.value, finish_reason="length", usage={}, timings={})
            else:
                if msg["type"] == MsgType.CANCEL.value:
                    self.cancels.append(msg["id"])
                continue
            self.sock.send_multipart([peer, pack(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture()
def fake_daemon(tmp_path: Path) -> Iterator[tuple[str, FakeDaemon]]:
    address = f"ipc://{tmp_path / 'fake.sock'}"
    fake = FakeDaemon(address)
    yield address, fake
    fake.close()


def test_generate_priority_reaches_the_wire(fake_daemon: tuple[str, FakeDaemon]) -> None:
    address, fake = fake_daemon
    args = build_parser().parse_args(["generate", "hi", "--addr", address, "--priority", "7"])
    assert args.func(args) == 0
    args = build_parser().parse_args(["generate", "hi", "--addr", address])
    assert args.func(args) == 0
    assert [m.get("priority", 0) for m in fake.submits] == [7, 0]
