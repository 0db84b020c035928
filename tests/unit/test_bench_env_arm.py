"""``mlx-batchd bench --env-arm NAME:VAR=VALUE[,VAR=VALUE]``: a good one is parsed into its arm, a bad
one (a variable the engine does not read, a value outside its choices, a name the bench's own arms
or another env arm hold) is refused in one line with the parser's exit code before anything starts;
and the start-up table reads what the meta holds."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.bench.env_arms import EnvArm
from scheduler.bench.startup import startup_markdown
from scheduler.cli import build_parser, main


def test_env_arms_are_parsed_in_order_with_their_variables() -> None:
    args = build_parser().parse_args(
        [
            *("bench", "--env-arm", "mlx-kernels:MLX_BATCHD_W4A16=0"),
            *("--env-arm", "faults2:MLX_BATCHD_TEST_FAULTS=request_token=257,engine_loop_after=40,MLX_BATCHD_W4A16="),
        ]
    )
    assert args.env_arm == [
        EnvArm("mlx-kernels", {"MLX_BATCHD_W4A16": "0"}),
        # a value may hold commas: the next variable starts at a comma followed by NAME=
        EnvArm("faults2", {"MLX_BATCHD_TEST_FAULTS": "request_token=257,engine_loop_after=40", "MLX_BATCHD_W4A16": ""}),
    ]
    assert build_parser().parse_args(["bench"]).env_arm == []


def no_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test (at once) if the bench gets past its options."""

    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the bench ran with a refused --env-arm")

    monkeypatch.setattr("scheduler.bench.main", started)
    monkeypatch.setattr("scheduler.spawn.DaemonProcess", started)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("mlx-kernels:MLX_BATCHD_NOPE=1", "'MLX_BATCHD_NOPE' is not an MLX_BATCHD_* variable"),
        ("mlx-kernels:PATH=/tmp", "'PATH' is not an MLX_BATCHD_* variable"),
        ("mlx-kernels:MLX_BATCHD_W4A16=2", "MLX_BATCHD_W4A16='2': expected one of '', '0', '1'"),
        ("daemon:MLX_BATCHD_W4A16=0", "arm name 'daemon' is taken by the bench's own arms"),
        ("raw:MLX_BATCHD_W4A16=0", "arm name 'raw' is taken"),
        ("Bad_Name:MLX_BATCHD_W4A16=0", "arm name 'Bad_Name': use lowercase letters, digits and hyphens"),
        ("mlx-kernels", "expected NAME:VAR=VALUE[,VAR=VALUE], got 'mlx-kernels'"),
        ("mlx-kernels:MLX_BATCHD_W4A16", "expected VAR=VALUE, got 'MLX_BATCHD_W4A16'"),
        ("x:MLX_BATCHD_W4A16=0,MLX_BATCHD_W4A16=1", "MLX_BATCHD_W4A16 given twice"),
    ],
)
def test_a_bad_env_arm_is_refused_in_one_line_before_anything_starts(
    value: str, said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no_bench(monkeypatch)
    with pytest.raises(SystemExit) as refused:
        main(["bench", "--model", "demo", "--env-arm", value])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mlx-batchd bench: argument --env-arm"), err
    assert said in err, err


def test_an_env_arm_name_given_twice_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no_bench(monkeypatch)
    with pytest.raises(SystemExit) as refused:
        main(["bench", "--env-arm", "a:MLX_BATCHD_W4A16=0", "--env-arm", "a:MLX_BATCHD_W4A16=1"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "arm name 'a' given twice" in err, err


def test_the_start_up_table_has_every_first_start_and_the_second_start() -> None:
    meta: dict[str, Any] = {
        "startup": {"daemon": {"ready_s": 1.5, "idle_s": 2.25}, "k": {"ready_s": 3.0, "idle_s": None}}
    }
    md = startup_markdown(meta)
    assert "| daemon | first | 1.50 | - | 2.25 |" in md and "| k | first | 3.00 | - | - |" in md
    assert "| second" not in md and "--restart-times" not in md
    meta["restart"] = {"daemon": "daemon", "ready_s": 0.5, "first_token_s": 0.75, "idle_s": 0.8, "exit_code": 0}
    assert "| daemon | second (`--restart-times`) | 0.50 | 0.75 | 0.80 |" in startup_markdown(meta)
    assert startup_markdown({}) == ""


def test_a_daemon_with_start_up_work_still_pending_or_running_is_not_idle() -> None:
    """The bench times nothing while a daemon's start-up work (kernel plans, checks) still runs, and
    counts its time to idle until that work ended, done or failed."""
    from scheduler.bench.arms import _idle

    row = {"at": "", "units": 1, "seconds": 0.1}
    engine: dict[str, Any] = {"active_sequences": 0, "verdicts": {}, "start_up": {}}
    assert _idle(engine)
    for status in ("pending", "running"):
        assert not _idle({**engine, "start_up": {"kernel plans": {**row, "status": status}}})
    assert _idle({**engine, "start_up": {"kernel plans": {**row, "status": "done"}, "x": {**row, "status": "failed"}}})
    assert _idle({"active_sequences": 0, "verdicts": {}})  # a daemon whose stats have no start-up work
