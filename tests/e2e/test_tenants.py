"""Multi-tenant serving over real CURVE sockets: authentication, isolation, fair share, limits."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from clients import Client, RequestError
from clients.protocol import PROTOCOL_VERSION, pack, unpack
from scheduler.tenants import TenantsError, load_tenants
from tests.conftest import Daemon, start_daemon
from tests.reference import greedy_reference

NAMES = ("server", "alice", "bob", "carol", "mallory")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Keypairs written by the real command, as a user would make them."""
    d = tmp_path_factory.mktemp("keys")
    for name in NAMES:
        out = subprocess.run(
            [sys.executable, "-m", "scheduler", "keys", "new", name, "--dir", str(d)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
    assert oct((d / "alice.key_secret").stat().st_mode)[-3:] == "600"
    return d


def _free_tcp() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def write_tenants(path: Path, keys: Path, tenants: dict[str, dict[str, Any]]) -> Path:
    lines = []
    for name, spec in tenants.items():
        lines.append(f"[tenants.{name}]")
        lines.append(f'keys = ["{keys / (name + ".key")}"]')
        lines += [f"{k} = {v}" for k, v in spec.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def creds(keys: Path, name: str) -> dict[str, str]:
    return {"curve_secret": str(keys / f"{name}.key_secret"), "server_key": str(keys / "server.key")}


def curve_daemon(
    tiny_model: Path, workdir: Path, keys: Path, tenants: dict[str, dict[str, Any]], *extra: str
) -> Daemon:
    workdir.mkdir(parents=True, exist_ok=True)
    table = write_tenants(workdir / "tenants.toml", keys, tenants)
    return start_daemon(
        tiny_model,
        workdir,
        "--tenants",
        str(table),
        "--curve-secret",
        str(keys / "server.key_secret"),
        *extra,
        address=_free_tcp(),
        client_kwargs=creds(keys, next(iter(tenants))),
    )


class RawCurve:
    """A bare CURVE DEALER, to see exactly what the daemon answers."""

    def __init__(self, address: str, keys: Path, name: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        public, secret = zmq.auth.load_certificate(str(keys / f"{name}.key_secret"))
        self.sock.curve_secretkey, self.sock.curve_publickey = secret, public
        self.sock.curve_serverkey = zmq.auth.load_certificate(str(keys / "server.key"))[0]
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self.sock.connect(address)

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.send(pack({"v": PROTOCOL_VERSION, **msg}))

    def recv(self) -> dict[str, Any]:
        return unpack(self.sock.recv(), 1 << 30)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def test_tcp_without_curve_is_refused_unless_insecure(tiny_model: Path, tmp_path: Path) -> None:
    addr = _free_tcp()
    out = subprocess.run(
        [sys.executable, "-m", "scheduler", "serve", "--model", str(tiny_model), "--listen", addr],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--insecure" in out.stderr
    d = start_daemon(tiny_model, tmp_path, "--insecure", address=addr)
    try:
        assert "INSECURE" in d.log()
    finally:
        assert d.stop() == 0


def test_bad_tenants_file_is_a_clear_startup_error(tiny_model: Path, tmp_path: Path, keys: Path) -> None:
    bad = tmp_path / "t.toml"
    bad.write_text("[tenants.x]\nkeys = []\nweight = 1\n")
    with pytest.raises(TenantsError, match="at least one key"):
        load_tenants(bad)
    bad.write_text(f'[tenants.x]\nkeys = ["{keys / "alice.key"}"]\nwieght = 1\n')
    with pytest.raises(TenantsError, match="unknown fields"):
        load_tenants(bad)


def test_no_key_wrong_key_and_revoked_key_are_refused_without_disturbing_others(
    tiny_model: Path, tmp_path: Path, keys: Path
) -> None:
    tenants = {"alice": {"weight": 1}, "bob": {"weight": 1}}
    d = curve_daemon(tiny_model, tmp_path, keys, tenants)
    try:
        result: dict[str, Any] = {}

        def alice_long() -> None:
            with Client(d.address, timeout=120, **creds(keys, "alice")) as c:
                result["r"] = c.generate(tokens=[5, 6, 7], max_tokens=120)

        worker = threading.Thread(target=alice_long)
        worker.start()
        with Client(d.address) as anonymous:  # no key at all: the handshake never completes
            with pytest.raises(TimeoutError):
                anonymous.health(timeout=1.0)
        with Client(d.address, **creds(keys, "mallory")) as stranger:  # a key no tenant owns
            with pytest.raises((RequestError, TimeoutError)):
                stranger.health(timeout=5.0)
        bob = RawCurve(d.address, keys, "bob")
        bob.send({"type": "health", "id": "h1"})
        assert bob.recv()["status"] == "ready"
        write_tenants(tmp_path / "tenants.toml", keys, {"alice": {"weight": 1}})  # bob revoked
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while True:  # bob's open connection: refused from the reload on
            bob.send({"type": "submit", "id": f"s{time.monotonic()}", "tokens": [5], "max_tokens": 2})
            reply = bob.recv()
            while reply["type"] == "token":
                reply = bob.recv()
            if reply.get("code") == "unauthorized":
                break
            assert time.monotonic() < deadline, reply
            time.sleep(0.1)
        bob.close()
        with Client(d.address, **creds(keys, "bob")) as new_bob:  # and a new connection with bob's key
            with pytest.raises((RequestError, TimeoutError)):
                new_bob.health(timeout=5.0)
        worker.join(timeout=120)
        assert result["r"].tokens == greedy_reference(tiny_model, [5, 6, 7], 120)[0]
    finally:
        assert d.stop() == 0


def test_a_tenant_cannot_cancel_or_observe_another_tenants_request(
    tiny_model: Path, tmp_path: Path, keys: Path
) -> None:
    d = curve_daemon(tiny_model, tmp_path, keys, {"alice": {}, "bob": {}})
    alice, bob = RawCurve(d.address, keys, "alice"), RawCurve(d.address, keys, "bob")
    try:
        alice.send({"type": "submit", "id": "shared-id", "tokens": [5, 6], "max_tokens": 40})
        first = alice.recv()
        assert first["type"] == "token"
        bob.send({"type": "cancel", "id": "shared-id"})
        refusal = bob.recv()
        assert refusal["type"] == "error" and refusal["code"] == "unknown_request_id"
        bob.send({"type": "submit", "id": "shared-id", "tokens": [9], "max_tokens": 3})  # same id, own request
        bob_events = [bob.recv()]
        while bob_events[-1]["type"] != "end":
            bob_events.append(bob.recv())
        alice_events = [first]
        while alice_events[-1]["type"] != "end":
            alice_events.append(alice.recv())
        assert alice_events[-1]["finish_reason"] in ("length", "stop")  # never cancelled by bob
        alice_tokens = [t for e in alice_events for t in e.get("tokens", [])]
        assert alice_tokens == greedy_reference(tiny_model, [5, 6], 40)[0]
        assert [t for e in bob_events for t in e.get("tokens", [])] == greedy_reference(tiny_model, [9], 3)[0]
    finally:
        alice.close()
        bob.close()
        assert d.stop() == 0


@pytest.mark.parametrize("bob_weight", [1, 3])
def test_fair_share_under_a_flood(tiny_model: Path, tmp_path: Path, keys: Path, bob_weight: int) -> None:
    """Alice floods (10x bob's requests, sent first); with one decode slot, VTC still gives bob his
    weighted share: from bob's arrival to his last request's end, served tokens (prompt +
    generated) divided by weight differ by at most two requests' worth."""
    tenants = {"alice": {"weight": 1}, "bob": {"weight": bob_weight, "admin": "true"}}  # bob may see alice's usage
    d = curve_daemon(tiny_model, tmp_path, keys, tenants, "--max-batch", "1")
    per_request = 8 + 16  # prompt + generated tokens
    bob_n = 12

    flood = RawCurve(d.address, keys, "alice")  # every flood request is at the daemon before bob's
    try:
        for i in range(10 * bob_n):
            flood.send({"type": "submit", "id": f"f{i}", "tokens": [5 + i % 50] * 8, "max_tokens": 16})
        time.sleep(0.3)
        bob = RawCurve(d.address, keys, "bob")  # bob's requests, too, all arrive at once
        bob.sock.setsockopt(zmq.RCVTIMEO, 300_000)
        with Client(d.address, timeout=300, **creds(keys, "bob")) as b:
            before = b.stats()["tenants"]["alice"]  # alice's service before bob arrived does not count
            for i in range(bob_n):
                bob.send({"type": "submit", "id": f"b{i}", "tokens": [7 + i] * 8, "max_tokens": 16})
            bob_ends = []
            while len(bob_ends) < bob_n:
                msg = bob.recv()
                if msg["type"] == "end":
                    bob_ends.append(msg)
            stats_at_bob_end = b.stats()["tenants"]
        bob.close()
    finally:
        flood.close()
        assert d.stop() == 0
    assert all(m["usage"]["completion_tokens"] == 16 for m in bob_ends)  # tiny model: no early EOS here
    served = {n: s["served_prompt_tokens"] + s["served_generated_tokens"] for n, s in stats_at_bob_end.items()}
    served["alice"] -= before["served_prompt_tokens"] + before["served_generated_tokens"]
    assert served["bob"] == bob_n * per_request
    gap = abs(served["alice"] / 1 - served["bob"] / bob_weight)
    assert gap <= 2 * per_request, (served, stats_at_bob_end)
    assert served["alice"] < 10 * bob_n * per_request / 2  # FIFO would have served alice's whole flood first


def test_queue_caps_answer_busy_at_once_and_limits_are_enforced(tiny_model: Path, tmp_path: Path, keys: Path) -> None:
    limits = {"max_concurrent": 1, "max_queued": 2, "max_prompt_tokens": 10, "max_new_tokens": 8}
    d = curve_daemon(tiny_model, tmp_path, keys, {"carol": limits, "alice": {}}, "--max-batch", "4")
    try:
        with Client(d.address, timeout=120, **creds(keys, "carol")) as c:
            with pytest.raises(RequestError) as too_long:
                c.generate(tokens=[5] * 11, max_tokens=2)
            assert too_long.value.code == "prompt_too_long" and "carol" in too_long.value.message
            with pytest.raises(RequestError) as too_many:
                c.generate(tokens=[5], max_tokens=9)
            assert too_many.value.code == "max_tokens_out_of_range" and "limit of 8" in too_many.value.message

            def one(i: int) -> Any:
                tic = time.monotonic()
                try:
                    return c.generate(tokens=[5 + i], max_tokens=8), time.monotonic() - tic
                except RequestError as exc:
                    return exc, time.monotonic() - tic

            with ThreadPoolExecutor(8) as pool:
                outcomes = list(pool.map(one, range(8)))
        busy = [(o, t) for o, t in outcomes if isinstance(o, RequestError)]
        served = [o for o, _ in outcomes if not isinstance(o, RequestError)]
        assert busy and all(o.code == "busy" and o.retry_after_s is not None and o.retry_after_s > 0 for o, _ in busy)
        assert all(t < 5.0 for _, t in busy)  # answered at once, not after waiting for a slot
        assert len(served) >= 3  # one decoding and two waiting at any time were let in
        assert all(r.finish_reason in ("length", "stop") for r in served)
    finally:
        assert d.stop() == 0


def test_default_ipc_socket_is_private(daemon: Daemon) -> None:
    path = Path(daemon.address[len("ipc://") :])
    assert oct(path.stat().st_mode)[-3:] == "600"
    assert oct(path.parent.stat().st_mode)[-3:] == "700"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("weight", "nan"),
        ("weight", "inf"),
        ("weight", "0"),
        ("token_rate", "inf"),
        ("token_rate", "-1.0"),
        ("token_burst", "nan"),
        ("priority_ceiling", "100000"),
        ("max_queued", "0"),
        ("admin", "1"),
    ],
)
def test_every_number_in_the_tenants_file_is_finite_and_in_range(
    tmp_path: Path, keys: Path, field: str, value: str
) -> None:
    bad = write_tenants(tmp_path / "t.toml", keys, {"alice": {}, "bob": {field: value}})
    with pytest.raises(TenantsError) as info:
        load_tenants(bad)
    message = str(info.value)
    assert str(bad) in message and "[tenants.bob]" in message and field in message and "\n" not in message


def test_a_bad_number_refuses_the_start_and_a_reload_keeps_the_old_table(
    tiny_model: Path, tmp_path: Path, keys: Path
) -> None:
    table = write_tenants(tmp_path / "bad.toml", keys, {"alice": {"weight": "nan"}})
    out = subprocess.run(
        [sys.executable, "-m", "scheduler", "serve", "--model", str(tiny_model), "--listen", _free_tcp()]
        + ["--tenants", str(table), "--curve-secret", str(keys / "server.key_secret")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert str(table) in lines[0] and "[tenants.alice].weight" in lines[0]

    d = curve_daemon(tiny_model, tmp_path / "d", keys, {"alice": {"weight": 2}})
    try:
        write_tenants(tmp_path / "d" / "tenants.toml", keys, {"alice": {"weight": "nan"}})
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "tenants file not reloaded" not in d.log() and "tenants reloaded" not in d.log():
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.05)
        assert "tenants file not reloaded" in d.log()
        with Client(d.address, timeout=60, **creds(keys, "alice")) as c:
            assert c.stats()["tenants"]["alice"]["weight"] == 2
    finally:
        assert d.stop() == 0


def test_a_removed_tenants_running_request_ends_unauthorized_at_once(
    tiny_model: Path, tmp_path: Path, keys: Path
) -> None:
    d = curve_daemon(tiny_model, tmp_path, keys, {"alice": {}, "bob": {}})
    bob = RawCurve(d.address, keys, "bob")
    try:
        bob.send({"type": "submit", "id": "long", "tokens": [5, 6, 7], "max_tokens": 4000})
        assert bob.recv()["type"] == "token"  # decoding
        write_tenants(tmp_path / "tenants.toml", keys, {"alice": {}})
        d.proc.send_signal(signal.SIGHUP)
        events = [bob.recv()]
        while events[-1]["type"] != "end":
            events.append(bob.recv())
        end = events[-1]
        assert end["finish_reason"] == "error" and end["error"]["code"] == "unauthorized", end
        assert end["usage"]["completion_tokens"] < 4000
        bob.send({"type": "health", "id": "h"})  # refused now; anything still due for "long" would come first
        after = bob.recv()
        assert after["id"] == "h" and after["code"] == "unauthorized", after  # one terminal event, nothing after
    finally:
        bob.close()
        assert d.stop() == 0


def test_a_tenant_sees_only_its_own_usage_and_an_admin_sees_all(tiny_model: Path, tmp_path: Path, keys: Path) -> None:
    d = curve_daemon(tiny_model, tmp_path, keys, {"alice": {"admin": "true"}, "bob": {}, "carol": {}})
    try:
        for name in ("bob", "carol"):
            with Client(d.address, timeout=60, **creds(keys, name)) as c:
                c.generate(tokens=[5, 6], max_tokens=3)
        for name in ("bob", "carol"):
            with Client(d.address, timeout=60, **creds(keys, name)) as c:
                s = c.stats()
            assert set(s["tenants"]) == {name} and set(s["outcomes"]) == {name}, s
            assert s["requests_completed"] >= 2  # global aggregates stay visible
        with Client(d.address, timeout=60, **creds(keys, "alice")) as c:
            s = c.stats()
        assert set(s["tenants"]) == {"alice", "bob", "carol"} and set(s["outcomes"]) == {"bob", "carol"}
    finally:
        assert d.stop() == 0
