"""The client refuses an ipc socket that another local user could have planted (issue 13, item 1).

Without ``XDG_RUNTIME_DIR`` the default socket lives under the shared temp dir, so another user
could create its folder first and bind a fake daemon there. The client checks the folder (and the
socket file) before it connects, and again when a connection is made, and sends nothing before.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import anyio
import pytest
import zmq

from clients import AsyncClient, Client, RequestError
from tests.conftest import start_daemon
from tests.helpers.client_safety import OTHER_UID, _refused, needs_root


def test_world_writable_folder_is_refused_and_a_private_one_connects(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(0o777)
    address = f"ipc://{folder / 'daemon.sock'}"
    err = _refused(address)
    assert str(folder) in err.message and "writable by other users (mode 777)" in err.message

    async def open_async() -> None:
        async with AsyncClient(address):
            pass

    with pytest.raises(RequestError) as info:
        anyio.run(open_async, backend="asyncio")
    assert info.value.code == "unsafe_address"

    folder.chmod(0o700)
    daemon = start_daemon(tiny_model, folder)
    try:
        with Client(daemon.address, timeout=60) as c:
            assert c.generate(tokens=[5, 6], max_tokens=3).finish_reason in ("length", "stop")
    finally:
        assert daemon.stop() == 0


@needs_root
def test_socket_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    path = folder / "daemon.sock"
    with socket.socket(socket.AF_UNIX) as planted:
        planted.bind(str(path))
        os.chown(path, OTHER_UID, OTHER_UID)
        err = _refused(f"ipc://{path}")
    assert f"{path} is owned by uid {OTHER_UID}" in err.message


@pytest.mark.parametrize("plant", ["world-writable", "other-owner"])
def test_folder_planted_after_the_client_started_gets_nothing(tmp_path: Path, plant: str) -> None:
    """A folder missing at start is allowed (the daemon creates it), so the check is repeated
    when the connection is made: a fake daemon there fails the call and never sees a message."""
    if plant == "other-owner" and os.getuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    folder = tmp_path / "run"
    address = f"ipc://{folder / 'daemon.sock'}"
    outcome: list[BaseException] = []
    with Client(address) as client:

        def ask() -> None:
            try:
                client.health(timeout=15)
            except BaseException as exc:  # inspected below
                outcome.append(exc)

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        folder.mkdir()
        if plant == "world-writable":
            folder.chmod(0o777)
        else:
            os.chown(folder, OTHER_UID, OTHER_UID)
        fake = zmq.Context.instance().socket(zmq.ROUTER)
        fake.setsockopt(zmq.LINGER, 0)
        fake.bind(address)
        try:
            asker.join(timeout=20)
            assert not asker.is_alive()
            assert len(outcome) == 1 and isinstance(outcome[0], RequestError), outcome
            assert outcome[0].code == "unsafe_address" and str(folder) in outcome[0].message
            assert fake.poll(500) == 0  # the request never reached the fake daemon
            with pytest.raises(RequestError) as info:  # and the client stays refused
                client.stats()
            assert info.value.code == "unsafe_address"
        finally:
            fake.close()
