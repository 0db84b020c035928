"""Local HTTP without tenants follows the ipc socket's rule: only the daemon's own user is served.

Against real daemons on 127.0.0.1: a request from another uid (a client process run as ``nobody``)
gets 403 ``forbidden`` and the same request from the daemon's uid is served; the key in the 0600 file
next to the socket lets a request in by itself, and is all that does with ``--http-local-auth key``
(how the daemon works where the OS does not tell a peer's uid); ``--insecure`` lifts the rule.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemon, start_daemon
from tests.e2e.test_http import http_url

NOBODY = 65534
#: What the other user runs: one GET with the standard library, printing the status and the body.
CLIENT = """
import sys, urllib.error, urllib.request
request = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer " + sys.argv[2]})
try:
    with urllib.request.urlopen(request, timeout=30) as r:
        print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
"""

other_user = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="runs a client as another user: Linux, root and setpriv",
)


def as_nobody(url: str, key: str = "no-key") -> tuple[int, dict[str, object]]:
    """GET ``url`` from a process of uid ``nobody``: the status and the JSON body."""
    out = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            "-I",
            "-c",
            CLIENT,
            url,
            key,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    status, _, body = out.stdout.strip().partition(" ")
    return int(status), json.loads(body)


def key_file(d: Daemon) -> Path:
    """The local key's file, as the daemon logs it at start."""
    found = re.search(r"the key in (\S+) \(Authorization: Bearer\)", d.log())
    assert found, d.log()
    return Path(found.group(1))


def refused(status: int, body: dict[str, object], path: Path) -> bool:
    error = body["error"]
    assert isinstance(error, dict)
    message = str(error["message"])
    return status == 403 and error["code"] == "forbidden" and str(path) in message and "\n" not in message


@other_user
def test_another_local_user_is_refused_and_the_daemons_user_served(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path, "--http", "127.0.0.1:0")
    try:
        url, path = http_url(d), key_file(d)
        assert path.parent == tmp_path and stat.S_IMODE(path.stat().st_mode) == 0o600
        status, body = as_nobody(f"{url}/v1/models")
        assert refused(status, body, path), (status, body)
        status, _ = as_nobody(f"{url}/health")
        assert status == 403
        mine = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer anything"})
        assert mine.status_code == 200 and mine.json()["data"][0]["id"] == tiny_model.name
        key = path.read_text().strip()
        status, body = as_nobody(f"{url}/v1/models", key)  # the key, however it was handed over
        assert status == 200, body
    finally:
        assert d.stop() == 0, d.log()
    assert not path.exists()  # removed at exit


def test_with_local_auth_key_only_the_key_is_served(tiny_model: Path, tmp_path: Path) -> None:
    """``--http-local-auth key``: what the daemon does where a peer's uid cannot be told."""
    d = start_daemon(tiny_model, tmp_path, "--http", "127.0.0.1:0", "--http-local-auth", "key")
    try:
        url, path = http_url(d), key_file(d)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        key = path.read_text().strip()
        bad = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer not-the-key"})
        assert refused(bad.status_code, bad.json(), path), bad.text
        assert httpx.get(f"{url}/health").status_code == 403
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"X-Api-Key": key}).status_code == 200
        completion = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 3},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
    finally:
        assert d.stop() == 0, d.log()
    assert not path.exists()


@other_user
def test_insecure_serves_every_local_user(tiny_model: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_model, tmp_path, "--http", "127.0.0.1:0", "--insecure")
    try:
        assert "the key in" not in d.log()
        status, body = as_nobody(f"{http_url(d)}/v1/models")
        assert status == 200, body
    finally:
        assert d.stop() == 0, d.log()
