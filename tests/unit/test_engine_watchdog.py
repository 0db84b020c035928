"""The engine watchdog's bookkeeping (what is pending, what counts as progress) on a given clock, and
the sweep of engine folders left by dead daemons. No daemon, no model."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from scheduler.engine_lifetime import FOLDER_PREFIX, OWNER_FILE, remove_stale_folders
from scheduler.engine_watchdog import STEP_MARGIN, Watchdog

T = 10.0  # the watchdog's timeout in these tests


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _dog(clock: Clock, words_waiting: bool = False, ready: bool = True) -> Watchdog:
    dog = Watchdog(T, lambda why: None, lambda: words_waiting, clock)
    if ready:
        dog.ready()
    return dog


def _quiet_for(dog: Watchdog, clock: Clock, seconds: float) -> str | None:
    clock.now += seconds
    return dog.overdue(clock.now)


def test_before_ready_nothing_is_watched() -> None:
    clock = Clock()
    dog = _dog(clock, ready=False)
    dog.submitted(1)
    assert _quiet_for(dog, clock, 10 * T) is None


def test_a_running_sequence_without_a_word_is_overdue_and_a_word_resets_the_clock() -> None:
    clock = Clock()
    dog = _dog(clock)
    dog.submitted(1)
    assert _quiet_for(dog, clock, T - 1) is None
    dog.heard([{"t": "step", "kind": "decode", "seconds": 0.01, "batch_size": 1}])
    assert _quiet_for(dog, clock, T - 1) is None
    why = _quiet_for(dog, clock, 2)
    assert why is not None and "1 sequence" in why and f"engine_timeout = {T:g} in the config file" in why


def test_a_bare_snapshot_is_no_progress_of_the_engine() -> None:
    """The engine process's main thread sends changed snapshots while the engine thread may be stuck."""
    clock = Clock()
    dog = _dog(clock)
    dog.submitted(1)
    clock.now += T - 1
    dog.heard([])
    assert _quiet_for(dog, clock, 2) is not None


def test_an_idle_engine_owes_nothing_and_its_idle_time_does_not_count() -> None:
    clock = Clock()
    dog = _dog(clock)
    dog.submitted(1)
    dog.heard([{"t": "finished", "seq": 1}])
    assert _quiet_for(dog, clock, 10 * T) is None
    # Work that arrives after a long idle spell gets its whole limit from its own arrival.
    dog.submitted(2)
    assert _quiet_for(dog, clock, T - 1) is None
    assert _quiet_for(dog, clock, 2) is not None


def test_paused_sequences_are_not_pending_until_resumed_or_cancelled() -> None:
    clock = Clock()
    dog = _dog(clock)
    dog.submitted(1)
    dog.paused(1)
    assert _quiet_for(dog, clock, 10 * T) is None
    dog.resumed(1)
    assert _quiet_for(dog, clock, T - 1) is None  # its clock starts at the resume
    assert _quiet_for(dog, clock, 2) is not None
    dog.paused(1)
    assert _quiet_for(dog, clock, 10 * T) is None
    dog.cancelled(1)  # owed its end, paused or not
    assert _quiet_for(dog, clock, T + 1) is not None
    dog.heard([{"t": "finished", "seq": 1}])
    assert _quiet_for(dog, clock, 10 * T) is None


def test_one_paused_among_running_ones_leaves_work_pending() -> None:
    clock = Clock()
    dog = _dog(clock)
    dog.submitted(1)
    dog.submitted(2)
    dog.paused(1)
    assert _quiet_for(dog, clock, T + 1) is not None


def test_a_shutdown_is_owed_its_answer() -> None:
    clock = Clock()
    dog = _dog(clock)
    dog.stopping()
    why = _quiet_for(dog, clock, T + 1)
    assert why is not None and "a shutdown" in why


def test_words_waiting_unread_count_as_progress() -> None:
    clock = Clock()
    dog = _dog(clock, words_waiting=True)
    dog.submitted(1)
    assert _quiet_for(dog, clock, T + 1) is None


def test_the_limit_stretches_to_the_longest_step_reported() -> None:
    clock = Clock()
    dog = _dog(clock)
    dog.submitted(1)
    dog.heard([{"t": "step", "kind": "prefill", "seconds": T, "batch_size": 1}])
    assert dog.limit_s() == STEP_MARGIN * T
    assert _quiet_for(dog, clock, T + 1) is None
    assert _quiet_for(dog, clock, STEP_MARGIN * T) is not None


def test_the_thread_calls_on_hung_once() -> None:
    said: list[str] = []
    dog = Watchdog(0.2, said.append, lambda: False)
    dog.ready()
    dog.submitted(1)
    dog.start()
    deadline = time.monotonic() + 10
    while not said and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.close()
    assert len(said) == 1 and dog.fired


def _folder(root: Path, name: str, owner: int | None) -> Path:
    folder = root / f"{FOLDER_PREFIX}{name}"
    folder.mkdir(mode=0o700)
    if owner is not None:
        (folder / OWNER_FILE).write_text(f"{owner}\n")
    return folder


def test_only_folders_of_dead_daemons_of_this_user_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = _folder(tmp_path, "stale", dead.pid)
    live = _folder(tmp_path, "live", os.getpid())
    unowned = _folder(tmp_path, "unowned", None)
    garbled = _folder(tmp_path, "garbled", None)
    (garbled / OWNER_FILE).write_text("not a pid")
    other_name = tmp_path / "something-else"
    other_name.mkdir()
    (other_name / OWNER_FILE).write_text(f"{dead.pid}\n")
    target = _folder(tmp_path, "target", dead.pid)
    link = tmp_path / f"{FOLDER_PREFIX}link"
    link.symlink_to(target)
    linked_owner = _folder(tmp_path, "linked-owner", None)
    (linked_owner / OWNER_FILE).symlink_to(target / OWNER_FILE)

    removed = remove_stale_folders(tmp_path)

    assert sorted(removed) == sorted([stale, target])
    for kept in (live, unowned, garbled, other_name, linked_owner):
        assert kept.exists(), kept
    assert link.is_symlink()  # a link is never followed nor removed


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a folder owned by another user")
def test_another_users_folder_is_left(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    theirs = _folder(tmp_path, "theirs", dead.pid)
    os.chown(theirs, 65534, 65534)
    assert remove_stale_folders(tmp_path) == []
    assert theirs.exists()
