"""The adaptive burst gate's estimate: what it reads and when it pauses bursts (no model: the gate
is arithmetic on timings, fed here the way the engine feeds it)."""

from __future__ import annotations

from collections.abc import Callable

from workers.api import BurstSettings
from workers.engine.spec.policy import (
    BLOCK_ROUNDS,
    EXPLORE_BLOCKS,
    EXPLORE_ROUNDS,
    REEXPLORE_ROUNDS,
    WARM_ROUNDS,
    Adaptive,
)

SETTINGS = BurstSettings(k=4, profile_steps=3, min_rounds=16, reprofile_after_s=30.0)


def _profiled(classic_s: float = 0.010) -> Adaptive:
    gate = Adaptive(SETTINGS)
    for _ in range(SETTINGS.profile_steps):
        assert gate.refusal(0.0) == "profiling"
        gate.observe_classic(classic_s)
    assert gate.refusal(0.0) is None
    return gate


def test_one_slow_first_round_does_not_pause_bursts_that_pay() -> None:
    """A first round that waited on compilation (here 50 classic steps) among rounds that pay
    (5 tokens for 2.5 classic steps: 2x) must not stop bursting."""
    gate = _profiled()
    gate.observe_round(0.5, 5)
    assert gate.after_round(1.0)
    for i in range(40):
        gate.observe_round(0.025, 5)
        assert gate.after_round(1.0 + i), f"paused after round {i + 2} (speedup {gate.speedup})"
    assert gate.speedup is not None and abs(gate.speedup - 2.0) < 1e-9
    assert gate.refusal(100.0) is None


def test_rounds_that_do_not_pay_pause_bursts_and_forget_them() -> None:
    gate = _profiled()
    for i in range(SETTINGS.min_rounds - 1):
        gate.observe_round(0.030, 2)  # 2 tokens for 3 classic steps
        assert gate.after_round(float(i)), "paused before min_rounds rounds were measured"
    gate.observe_round(0.030, 2)
    assert not gate.after_round(10.0)
    assert gate.refusal(10.0 + SETTINGS.reprofile_first_s / 2) == "adaptive"
    assert gate.refusal(10.0 + SETTINGS.reprofile_first_s + 0.01) == "profiling"  # measured afresh
    assert (gate.rounds, gate.round_s, gate.tokens_per_round, gate.classic_step_s) == (0, None, None, None)


def _pause_after(gate: Adaptive, now: float, seconds: float, tokens: int) -> float | None:
    """Profile, then ``min_rounds`` rounds of ``seconds`` and ``tokens`` from ``now``: how long the
    gate then paused (``None``: it kept bursting)."""
    for _ in range(SETTINGS.profile_steps):
        gate.observe_classic(0.010)
    for _ in range(SETTINGS.min_rounds):
        gate.observe_round(seconds, tokens)
        if not gate.after_round(now):
            return gate.paused_until - now
    return None


def test_pauses_double_while_bursts_do_not_pay_and_start_short_again_after_a_window_that_paid() -> None:
    """A pause that a noisy window caused costs a second, not the longest pause; a pairing that
    never pays is retried less and less often, up to ``reprofile_after_s``."""
    gate = Adaptive(SETTINGS)
    lengths = [_pause_after(gate, 1000.0 * i, 0.030, 2) for i in range(7)]
    first, longest = SETTINGS.reprofile_first_s, SETTINGS.reprofile_after_s
    assert lengths == [min(longest, first * 2**i) for i in range(7)]
    assert _pause_after(gate, 8000.0, 0.020, 5) is None  # 2x: pays, and the next pause is short
    for _ in range(SETTINGS.window_rounds):
        gate.observe_round(0.030, 1)
        if not gate.after_round(9000.0):
            break
    assert gate.paused_until == 9000.0 + first


def test_the_estimate_reads_the_latest_rounds() -> None:
    """Rounds that paid once and stopped paying (acceptance fell) pause bursting once the window
    holds the new ones: an all-time figure would keep bursting for as long as it had paid."""
    gate = _profiled()
    for i in range(100):
        gate.observe_round(0.020, 5)
        assert gate.after_round(float(i))
    paused_at = None
    for i in range(SETTINGS.window_rounds):
        gate.observe_round(0.020, 1)  # 1 token for 2 classic steps
        if not gate.after_round(100.0 + i):
            paused_at = i
            break
    assert paused_at is not None and paused_at < SETTINGS.window_rounds


def test_a_stretch_of_slow_rounds_among_rounds_that_pay_does_not_pause() -> None:
    """``min_rounds`` rounds that lose (a busy host, a stretch of low acceptance) after rounds that
    pay 2x: the window reads them among the others and bursting goes on."""
    gate = _profiled()
    for i in range(SETTINGS.window_rounds - SETTINGS.min_rounds):
        gate.observe_round(0.025, 5)
        assert gate.after_round(float(i))
    for i in range(SETTINGS.min_rounds):
        gate.observe_round(0.040, 3)  # 0.75x on its own
        assert gate.after_round(100.0 + i), f"paused after {i + 1} slow rounds (speedup {gate.speedup})"


def test_a_slow_classic_step_does_not_make_rounds_look_faster() -> None:
    """The classic figure is the median of its latest steps: one step that waited (a prefill's
    allocation, a busy host) does not make rounds that lose look like a win."""
    gate = Adaptive(SETTINGS)
    for seconds in (0.010, 0.200, 0.010):
        gate.observe_classic(seconds)
    for i in range(SETTINGS.min_rounds):
        gate.observe_round(0.030, 2)
        kept = gate.after_round(float(i))
    assert not kept


#: The ways an exploration takes, round by round: the warm-up built ahead, then the blocks.
EXPLORATION = [True] * WARM_ROUNDS + [way for way in EXPLORE_BLOCKS for _ in range(BLOCK_ROUNDS)]


def _rounds_by_way(
    gate: Adaptive, seconds: dict[bool, float] | Callable[[int, bool], float], n: int, start: int = 0
) -> list[bool]:
    """``n`` rounds that can build ahead, each taking ``seconds[way]`` (or ``seconds(i, way)``, ``i``
    counted from ``start``) for the way the gate chose."""
    ways = []
    for i in range(start, start + n):
        way = gate.build_ahead()
        ways.append(way)
        gate.observe_round(seconds(i, way) if callable(seconds) else seconds[way], 5, way)
        assert gate.after_round(float(i))
    return ways


def test_building_ahead_is_timed_both_ways_and_the_faster_kept() -> None:
    for faster in (True, False):
        gate = _profiled()
        seconds = {faster: 0.010, not faster: 0.014}
        ways = _rounds_by_way(gate, seconds, EXPLORE_ROUNDS + 20)
        assert len(EXPLORATION) == EXPLORE_ROUNDS and ways[:EXPLORE_ROUNDS] == EXPLORATION
        assert set(ways[EXPLORE_ROUNDS:]) == {faster}
        assert gate.ahead_medians() == {"on": seconds[True], "off": seconds[False]}


def test_first_rounds_and_a_drifting_host_do_not_decide_the_way() -> None:
    """The warm-up's rounds (first uses: kernels compiled, seconds each) are timed for neither way,
    and a host that slows down steadily while the ways are timed slows both alike: not building ahead
    is 5 % faster here, under first rounds of a second and a round time that grows 3 % a round. Timed
    one way after the other, the way timed first would win on both counts."""
    gate = _profiled()

    def seconds(i: int, way: bool) -> float:
        return 1.0 if i < WARM_ROUNDS else (0.010 if way else 0.0095) * (1 + 0.03 * i)

    ways = _rounds_by_way(gate, seconds, WARM_ROUNDS)
    assert gate.ahead_medians() == {"on": None, "off": None}  # the warm-up: timed for neither way
    ways += _rounds_by_way(gate, seconds, EXPLORE_ROUNDS + 1 - WARM_ROUNDS, start=WARM_ROUNDS)
    assert ways[:EXPLORE_ROUNDS] == EXPLORATION and ways[EXPLORE_ROUNDS] is False


def test_bursting_is_not_paused_while_the_ways_are_timed() -> None:
    """Rounds of neither way pay (5 tokens in 10 classic steps): bursting goes on through the
    exploration (bounded: ``EXPLORE_ROUNDS``) and pauses at the round that completes it."""
    gate = _profiled()
    for i in range(EXPLORE_ROUNDS - 1):
        way = gate.build_ahead()
        gate.observe_round(0.1, 5, way)
        assert gate.after_round(float(i))
    gate.observe_round(0.1, 5, gate.build_ahead())
    assert not gate.after_round(float(EXPLORE_ROUNDS))


def test_building_ahead_is_timed_afresh_once_the_host_changes() -> None:
    """The way not kept is timed again every ``REEXPLORE_ROUNDS`` rounds: once not building ahead
    got faster (the host changed), rounds stop being built ahead."""
    gate = _profiled()
    ways = _rounds_by_way(gate, {True: 0.010, False: 0.014}, REEXPLORE_ROUNDS)
    assert set(ways[EXPLORE_ROUNDS:]) == {True}
    ways = _rounds_by_way(gate, {True: 0.010, False: 0.006}, 2 * EXPLORE_ROUNDS)
    assert ways[:EXPLORE_ROUNDS] == EXPLORATION
    assert set(ways[EXPLORE_ROUNDS:]) == {False}


def test_rounds_that_cannot_build_ahead_leave_the_choice_alone() -> None:
    gate = _profiled()
    for i in range(3 * EXPLORE_ROUNDS):
        gate.observe_round(0.001, 5, None)  # audited or sampled rounds: no way to time
        assert gate.after_round(float(i))
    assert gate.ahead_medians() == {"on": None, "off": None} and gate.build_ahead()


def test_fixed_settings_do_not_choose() -> None:
    always = Adaptive(BurstSettings(lookahead=True, lookahead_choice=False))
    never = Adaptive(BurstSettings(lookahead=False))
    for _ in range(3 * EXPLORE_ROUNDS):
        assert always.build_ahead() and not never.build_ahead()
        always.observe_round(0.02, 5, True)


def test_timing_the_slower_way_does_not_pause_bursting_that_pays() -> None:
    """Rounds built ahead pay (5 tokens for 2.5 classic steps), rounds not built ahead do not (5 for
    10): the 8 rounds spent timing the slower way leave the gate's estimate on the faster one (a
    median over both ways' rounds would read 0.8x and pause)."""
    gate = _profiled()
    ways = _rounds_by_way(gate, {True: 0.025, False: 0.100}, 2 * EXPLORE_ROUNDS)
    assert False in ways and set(ways[EXPLORE_ROUNDS:]) == {True}
    assert gate.speedup is not None and abs(gate.speedup - 2.0) < 1e-9
