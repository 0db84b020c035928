"""The client refuses an ipc socket folder that another local user could have planted (issue 13,
item 1), before it connects: checks of the folder alone, with no socket and no daemon."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.client_safety import OTHER_UID, _refused, needs_root


@needs_root
def test_folder_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, OTHER_UID)
    err = _refused(f"ipc://{folder / 'daemon.sock'}")
    assert f"{folder} is owned by uid {OTHER_UID}" in err.message


def test_symlinked_folder_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    err = _refused(f"ipc://{link / 'daemon.sock'}")
    assert f"{link} is a symbolic link" in err.message
