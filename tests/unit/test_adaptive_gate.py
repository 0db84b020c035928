"""The adaptive burst gate's estimate: what it reads and when it pauses bursts (no model: the gate
is arithmetic on timings, fed here the way the engine feeds it)."""

from __future__ import annotations

from workers.burst import Adaptive, BurstSettings

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
    assert gate.refusal(10.0 + SETTINGS.reprofile_after_s / 2) == "adaptive"
    assert gate.refusal(10.0 + SETTINGS.reprofile_after_s + 1) == "profiling"  # measured afresh
    assert (gate.rounds, gate.round_s, gate.tokens_per_round, gate.classic_step_s) == (0, None, None, None)


def test_the_estimate_reads_the_latest_rounds() -> None:
    """Rounds that paid once and stopped paying (acceptance fell) pause bursting once the window
    holds the new ones: an all-time figure would keep bursting for as long as it had paid."""
    gate = _profiled()
    for i in range(100):
        gate.observe_round(0.020, 5)
        assert gate.after_round(float(i))
    paused_at = None
    for i in range(SETTINGS.min_rounds):
        gate.observe_round(0.020, 1)  # 1 token for 2 classic steps
        if not gate.after_round(100.0 + i):
            paused_at = i
            break
    assert paused_at is not None and paused_at < SETTINGS.min_rounds


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
