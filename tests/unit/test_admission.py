"""Admission waves as a policy (``workers.engine.arrivals``): which commands an iteration applies, given
what arrived, whether the engine has work, and the clock (passed in, so nothing here waits)."""

from __future__ import annotations

import pytest

from workers.api import Cancel, Command, Job, Shutdown, SubmitJob
from workers.engine.arrivals import IDLE_HOLD_MAX, IDLE_HOLD_S, AdmissionWaves


def sub(seq: int) -> SubmitJob:
    return SubmitJob(Job(seq=seq, prompt=[1, 2], max_tokens=4))


def seqs(cmds: list[Command]) -> list[object]:
    return [c.job.seq if isinstance(c, SubmitJob) else type(c).__name__ for c in cmds]


def test_window_zero_applies_every_arrival_at_once() -> None:
    a = AdmissionWaves(wave=8, window_s=0.0)
    assert seqs(a.take([sub(1)], busy=True, now=0.0)) == [1]
    assert a.held == [] and a.delayed == 0


def test_an_idle_engine_never_holds_an_arrival() -> None:
    a = AdmissionWaves(wave=8, window_s=10.0)
    assert seqs(a.take([sub(1)], busy=False, now=0.0)) == [1]
    assert a.delayed == 0


def test_arrivals_mid_batch_wait_for_a_full_wave_and_join_in_order() -> None:
    a = AdmissionWaves(wave=3, window_s=10.0)
    assert a.take([sub(1)], busy=True, now=0.0) == []
    assert a.take([], busy=True, now=1.0) == []
    assert a.take([sub(2)], busy=True, now=2.0) == []
    assert seqs(a.take([sub(3)], busy=True, now=3.0)) == [1, 2, 3]
    assert a.held == [] and a.since is None
    assert a.delayed == 2  # 3 joined in the iteration that took it


def test_the_window_counts_from_the_oldest_held_arrival() -> None:
    a = AdmissionWaves(wave=8, window_s=0.5)
    assert a.take([sub(1)], busy=True, now=10.0) == []
    assert a.take([sub(2)], busy=True, now=10.4) == []
    assert seqs(a.take([], busy=True, now=10.5)) == [1, 2]
    assert a.take([sub(3)], busy=True, now=10.6) == []  # a new window starts with the next arrival
    assert a.since == 10.6


def test_held_arrivals_go_out_when_the_engine_runs_dry() -> None:
    a = AdmissionWaves(wave=8, window_s=10.0)
    assert a.take([sub(1)], busy=True, now=0.0) == []
    assert seqs(a.take([], busy=False, now=0.1)) == [1]


def test_a_cancel_or_shutdown_lets_every_held_arrival_in_first() -> None:
    """A cancel for a held request must find it admitted; a shutdown must end it like the rest."""
    a = AdmissionWaves(wave=8, window_s=10.0)
    assert a.take([sub(1), sub(2)], busy=True, now=0.0) == []
    assert seqs(a.take([sub(3), Cancel(2, "cancelled", None, None), sub(4)], busy=True, now=0.1)) == [
        1,
        2,
        3,
        "Cancel",
        4,
    ]
    assert a.take([sub(5)], busy=True, now=0.2) == []
    assert seqs(a.take([Shutdown("error", "shutdown", "bye")], busy=True, now=0.3)) == [5, "Shutdown"]


def test_an_idle_window_holds_arrivals_for_an_idle_engine_until_it_ends_or_a_wave_fills() -> None:
    a = AdmissionWaves(wave=3, window_s=10.0, idle_window_s=0.01)
    assert a.wait_s(0.0) is None  # nothing held: the loop may block for the next command
    assert a.take([sub(1)], busy=False, now=1.0) == []
    assert a.wait_s(1.004) == pytest.approx(0.006)
    assert seqs(a.take([], busy=False, now=1.01)) == [1]
    assert a.wait_s(1.02) is None
    assert a.take([sub(2)], busy=False, now=2.0) == []
    assert a.take([sub(3)], busy=False, now=2.001) == []
    assert seqs(a.take([sub(4)], busy=False, now=2.002)) == [2, 3, 4]  # a full wave goes at once
    assert a.delayed == 3


def test_an_idle_engine_holds_arrivals_until_a_quiet_window_passes_and_never_past_the_cap() -> None:
    a = AdmissionWaves(wave=64, window_s=10.0, idle_window_s=0.01)
    assert a.take([sub(1)], busy=False, now=1.0) == []
    assert a.take([sub(2)], busy=False, now=1.006) == []
    assert a.take([sub(3)], busy=False, now=1.012) == []  # 12 ms after the first: the latest restarted the window
    assert a.wait_s(1.015) == pytest.approx(0.007)
    assert a.take([], busy=False, now=1.02) == []
    assert seqs(a.take([], busy=False, now=1.022)) == [1, 2, 3]  # 10 ms without an arrival
    for i in range(8):  # a trickle 8 ms apart goes in 5 windows after its first arrival
        out = a.take([sub(10 + i)], busy=False, now=2.0 + 0.008 * i)
        if out:
            break
    assert i == 7 and seqs(out) == list(range(10, 18))  # 2.048 < 2.0 + 5 windows <= 2.056
    assert IDLE_HOLD_MAX == 5
    assert a.wait_s(3.0) is None


def test_a_short_idle_window_keeps_the_cap_of_the_default_one() -> None:
    """A 2 ms quiet window lets a lone arrival in after 2 ms, and still gathers a group that arrives
    1.5 ms apart for up to ``IDLE_HOLD_S`` (not 5 short windows)."""
    a = AdmissionWaves(wave=64, window_s=10.0, idle_window_s=0.002)
    assert a.take([sub(1)], busy=False, now=1.0) == []
    assert a.wait_s(1.0) == pytest.approx(0.002)
    assert seqs(a.take([], busy=False, now=1.002)) == [1]
    out: list[Command] = []
    for i in range(40):  # 1.5 ms apart: each arrival restarts the window, until the 50 ms cap
        out = a.take([sub(10 + i)], busy=False, now=2.0 + 0.0015 * i)
        if out:
            break
    assert IDLE_HOLD_S == 0.05 and seqs(out) == list(range(10, 10 + i + 1))
    assert 2.0 + 0.0015 * i >= 2.05 > 2.0 + 0.0015 * (i - 1)  # let in at the cap, not at 5 windows (10 ms)


def grouped(seq: int, group: str | None, size: int) -> SubmitJob:
    return SubmitJob(Job(seq=seq, prompt=[1, 2], max_tokens=4, group=group, group_size=size))


def test_a_declared_lone_arrival_goes_in_at_once_and_an_undeclared_one_waits_the_window() -> None:
    a = AdmissionWaves(wave=64, window_s=10.0, idle_window_s=0.01)
    assert seqs(a.take([grouped(1, "c/g", 1)], busy=False, now=1.0)) == [1]
    assert a.delayed == 0
    assert a.take([sub(2)], busy=False, now=2.0) == []
    assert seqs(a.take([], busy=False, now=2.01)) == [2]
    assert a.delayed == 1


def test_a_declared_group_goes_in_when_its_last_member_arrives() -> None:
    a = AdmissionWaves(wave=64, window_s=10.0, idle_window_s=0.01)
    assert a.take([grouped(1, "c/g", 3)], busy=False, now=1.0) == []
    assert a.take([grouped(2, "c/g", 3)], busy=False, now=1.001) == []
    assert seqs(a.take([grouped(3, "c/g", 3)], busy=False, now=1.002)) == [1, 2, 3]  # no quiet 10 ms
    assert a.take([grouped(4, "c/h", 2)], busy=True, now=3.0) == []  # the busy engine's hold too
    assert seqs(a.take([grouped(5, "c/h", 2)], busy=True, now=3.001)) == [4, 5]
    assert a.idle_hold_seconds == pytest.approx(0.002)  # the idle engine's 2 ms; the busy one ran meanwhile


def test_an_idle_engine_counts_the_seconds_it_held_arrivals() -> None:
    """From a hold's first arrival to its release, only for holds that began on an idle engine:
    that is wall time the engine alone (all prompts at once) does not have."""
    a = AdmissionWaves(wave=64, window_s=10.0, idle_window_s=0.01)
    assert seqs(a.take([grouped(1, "c/g", 1)], busy=False, now=1.0)) == [1]
    assert a.idle_hold_seconds == 0.0  # a declared lone request is not held
    assert a.take([sub(2)], busy=False, now=2.0) == []
    assert a.take([sub(3)], busy=False, now=2.004) == []
    assert seqs(a.take([], busy=False, now=2.014)) == [2, 3]
    assert a.idle_hold_seconds == pytest.approx(0.014)
    assert a.take([sub(4)], busy=True, now=3.0) == []  # held by a busy engine: not counted
    assert seqs(a.take([], busy=False, now=3.5)) == [4]
    assert a.take([sub(5)], busy=False, now=4.0) == []  # a cancel lets the hold go early
    assert seqs(a.take([Cancel(9, "cancelled", None, None)], busy=False, now=4.003)) == [5, "Cancel"]
    assert a.idle_hold_seconds == pytest.approx(0.017)


def test_declarations_never_cut_short_what_others_wait_for() -> None:
    """A whole group with an undeclared arrival, or with another sender's group still short of members,
    keeps the window; groups are told apart by name (the front end scopes names to a connection)."""
    a = AdmissionWaves(wave=64, window_s=10.0, idle_window_s=0.01)
    assert a.take([grouped(1, "c1/g", 1), sub(2)], busy=False, now=1.0) == []
    assert seqs(a.take([], busy=False, now=1.01)) == [1, 2]
    assert a.take([grouped(3, "c1/g", 2), grouped(4, "c2/g", 2)], busy=False, now=2.0) == []  # 1 of 2 each
    assert a.take([grouped(5, "c1/g", 2)], busy=False, now=2.001) == []  # c2/g still short
    assert seqs(a.take([grouped(6, "c2/g", 2)], busy=False, now=2.002)) == [3, 4, 5, 6]


def test_a_group_short_of_members_waits_no_longer_than_an_undeclared_arrival() -> None:
    a = AdmissionWaves(wave=64, window_s=10.0, idle_window_s=0.01)
    assert a.take([grouped(1, "c/g", 5)], busy=False, now=1.0) == []
    assert a.wait_s(1.0) == pytest.approx(0.01)
    assert seqs(a.take([], busy=False, now=1.01)) == [1]
