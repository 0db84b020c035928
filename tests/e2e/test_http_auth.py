"""HTTP API keys and tenants: keys from the real `keys new-api` command, hashes in tenants.toml, 401s,
per-tenant limits and outcomes, 429 with Retry-After, 503 while draining, and the start-up refusals."""

from __future__ import annotations

import hashlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from clients import Client
from scheduler.tenants import TenantsError, load_tenants
from tests.conftest import Daemon, start_daemon
from tests.e2e.test_http import http_url, wait_until
from tests.helpers.daemons import tenants_daemon

#: A tenant whose token bucket (rate 0.01/s) holds its second request in the queue for many minutes,
#: and whose queue holds one: a deterministic waiting request, and a deterministic `busy`.
SLOW = "token_rate = 0.01\ntoken_burst = 1\nmax_queued = 1\n"


def mlx_batchd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler", *args], capture_output=True, text=True, timeout=120, check=False
    )


def new_api_key(name: str) -> tuple[str, str]:
    """The key and the tenants.toml line, as `keys new-api` prints them."""
    out = mlx_batchd("keys", "new-api", name)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    return lines[1].strip(), lines[3].strip()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A CURVE key for the daemon and the operator, an API key for alice, bob and slow, and the
    tenants file with the lines `keys new-api` printed pasted in."""
    d = tmp_path_factory.mktemp("http-auth")
    for name in ("server", "ops"):
        assert mlx_batchd("keys", "new", name, "--dir", str(d)).returncode == 0
    keys, text = {}, f'[tenants.ops]\nkeys = ["{d / "ops.key"}"]\nadmin = true\n'
    for name, extra in (("alice", "max_new_tokens = 8\n"), ("bob", ""), ("slow", SLOW)):
        keys[name], line = new_api_key(name)
        text += f"[tenants.{name}]\n{line}\n{extra}"
    (d / "tenants.toml").write_text(text)
    return d, keys


@pytest.fixture(scope="module")
def daemon(
    tiny_model: Path, setup: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = tenants_daemon(tiny_model, setup[0], tmp_path_factory.mktemp("d"))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture()
def ops(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=60, **daemon.process.client_kwargs) as c:
        yield c


def outcomes(ops: Client, tenant: str) -> dict[str, int]:
    return dict(ops.stats()["outcomes"].get(tenant, {}))


def test_keys_new_api_prints_a_fresh_key_once_and_only_its_hash_for_the_file() -> None:
    key, line = new_api_key("alice")
    again, _ = new_api_key("alice")
    assert key != again and len(key) > 40
    assert line == f'api_keys_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]'
    bad = mlx_batchd("keys", "new-api", "not a name")
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1


def test_the_file_holds_digests_only(tmp_path: Path) -> None:
    key, line = new_api_key("x")
    path = tmp_path / "t.toml"
    path.write_text(f'[tenants.x]\napi_keys_sha256 = ["{key}"]\n')
    with pytest.raises(TenantsError, match="not a SHA-256 hex digest"):
        load_tenants(path)
    path.write_text(f"[tenants.x]\n{line}\n[tenants.y]\n{line}\n")
    with pytest.raises(TenantsError, match="belongs to both"):
        load_tenants(path)
    path.write_text(f"[tenants.x]\n{line}\n")
    assert load_tenants(path).by_api_key_hash(hashlib.sha256(key.encode()).hexdigest()) is not None


def test_a_missing_and_a_wrong_key_get_the_same_401(daemon: Daemon, setup: tuple[Path, dict[str, str]]) -> None:
    url = http_url(daemon)
    body = {"model": "tiny-llama", "prompt": "a", "max_tokens": 2}
    answers = [
        httpx.post(f"{url}/v1/completions", json=body),
        httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer mlxb-wrong"}),
        httpx.post(f"{url}/v1/completions", json=body, headers={"X-Api-Key": "mlxb-wrong"}),
        httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {setup[1]['alice']}x"}),
    ]
    assert [r.status_code for r in answers] == [401] * 4
    assert len({r.text for r in answers}) == 1 and answers[0].json()["error"]["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=f"{url}/v1", api_key="mlxb-wrong", max_retries=0) as oai:
        with pytest.raises(openai.AuthenticationError):
            oai.models.list()
    assert httpx.get(f"{url}/health").status_code == 200  # no key needed to see that it is up


def test_each_key_serves_its_own_tenant_within_its_limits(
    daemon: Daemon, setup: tuple[Path, dict[str, str]], ops: Client
) -> None:
    url, keys = http_url(daemon), setup[1]
    alice0, bob0 = outcomes(ops, "alice"), outcomes(ops, "bob")
    with openai.OpenAI(base_url=f"{url}/v1", api_key=keys["alice"], max_retries=0) as alice:
        assert alice.completions.create(model="tiny-llama", prompt="a", max_tokens=3).choices[0].text is not None
        with pytest.raises(openai.BadRequestError) as over:
            alice.completions.create(model="tiny-llama", prompt="a", max_tokens=9)  # alice: max_new_tokens = 8
        assert "alice" in over.value.message and over.value.body["param"] == "max_tokens"  # type: ignore[index]
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
        headers={"X-Api-Key": keys["bob"]},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    alice1, bob1 = outcomes(ops, "alice"), outcomes(ops, "bob")
    assert alice1.get("length", 0) == alice0.get("length", 0) + 1
    assert alice1.get("max_tokens_out_of_range", 0) == alice0.get("max_tokens_out_of_range", 0) + 1
    assert bob1.get("length", 0) == bob0.get("length", 0) + 1 and sum(bob1.values()) == sum(bob0.values()) + 1


def _hold_a_waiting_request(url: str, key: str, ops: Client) -> socket.socket:
    """Send the slow tenant's second request on a raw socket and return it while it waits for its
    token bucket (the first request overdrew it)."""
    httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "abc", "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    ).raise_for_status()
    body = b'{"prompt": "abc", "max_tokens": 4}'
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: ops.stats()["tenants"]["slow"]["waiting"] == 1, "the second request waits")
    return s


def test_a_full_queue_is_429_with_retry_after_and_leaving_frees_the_request(
    daemon: Daemon, setup: tuple[Path, dict[str, str]], ops: Client
) -> None:
    url, key = http_url(daemon), setup[1]["slow"]
    waiting = _hold_a_waiting_request(url, key, ops)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a"}, headers={"Authorization": f"Bearer {key}"})
    err = r.json()["error"]
    assert r.status_code == 429 and err["code"] == "busy" and int(r.headers["Retry-After"]) >= 1
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as slow:
        with pytest.raises(openai.RateLimitError):
            slow.completions.create(model="tiny-llama", prompt="a")
    before = outcomes(ops, "slow").get("disconnected", 0)
    waiting.close()  # a client that leaves while waiting: its request ends and leaves the queue
    wait_until(lambda: outcomes(ops, "slow").get("disconnected", 0) == before + 1, "the request ended disconnected")
    assert ops.stats()["tenants"]["slow"]["waiting"] == 0 and ops.stats()["requests_in_flight"] == 0


def test_while_draining_new_requests_get_503(
    tiny_model: Path, setup: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    d = tenants_daemon(tiny_model, setup[0], tmp_path, "--drain-timeout", "120")
    try:
        url, key = http_url(d), setup[1]["slow"]
        with Client(d.address, timeout=60, **d.process.client_kwargs) as ops:
            waiting = _hold_a_waiting_request(url, key, ops)
            d.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, "the daemon drains")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a"}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutdown"
        assert httpx.get(f"{url}/health").json()["status"] == "shutting_down"
        waiting.close()  # the last request in flight leaves: the drain is over
        assert d.proc.wait(timeout=60) == 0
    finally:
        d.stop()


def test_non_loopback_http_needs_tenants_or_insecure(tiny_model: Path, tmp_path: Path) -> None:
    base = ["serve", "--model", str(tiny_model), "--listen", f"ipc://{tmp_path / 's' / 'd.sock'}"]
    out = mlx_batchd(*base, "--http", "0.0.0.0:0")
    assert out.returncode == 2 and "--insecure" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    d = start_daemon(tiny_model, tmp_path / "insecure", "--http", "0.0.0.0:0", "--insecure")
    try:
        assert "INSECURE: --http" in d.log()
        port = http_url(d).rsplit(":", 1)[1]
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ready"
    finally:
        assert d.stop() == 0


def test_a_busy_http_address_is_one_line_and_exit_1(tiny_model: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = mlx_batchd(
            "serve",
            "--model",
            str(tiny_model),
            "--listen",
            f"ipc://{tmp_path / 'd.sock'}",
            "--http",
            f"127.0.0.1:{port}",
        )
    assert out.returncode == 1, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and f"--http 127.0.0.1:{port}" in out.stderr


def test_sighup_applies_a_removed_and_a_restored_api_key(daemon: Daemon, setup: tuple[Path, dict[str, str]]) -> None:
    url, (d, keys) = http_url(daemon), setup
    table = d / "tenants.toml"
    original = table.read_text()
    bob_line = f'api_keys_sha256 = ["{hashlib.sha256(keys["bob"].encode()).hexdigest()}"]'
    assert bob_line in original

    def bob_status() -> int:
        return httpx.get(f"{url}/v1/models", headers={"X-Api-Key": keys["bob"]}).status_code

    assert bob_status() == 200
    try:
        table.write_text(original.replace(bob_line, 'api_keys_sha256 = ["' + "0" * 64 + '"]'))
        daemon.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: bob_status() == 401, "bob's removed key is refused")
    finally:
        table.write_text(original)
        daemon.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: bob_status() == 200, "bob's restored key is accepted")
