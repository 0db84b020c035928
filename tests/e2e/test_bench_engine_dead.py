"""A daemon whose engine dies under ``mlx-batchd bench`` ends the bench in one line naming the arm and
the error's code, with exit 1: never a traceback."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from clients import Client, RequestError
from scheduler.bench.arms import failing_arm, run_daemon
from scheduler.bench.output import BenchError
from scheduler.cli import build_parser
from tests.conftest import start_daemon


def test_the_daemon_arm_of_a_daemon_whose_engine_died_fails_in_one_line(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected at the named test seam: the engine loop raises after 150 iterations."""
    monkeypatch.setenv("MLX_BATCHD_TEST_FAULTS", "engine_loop_after=150")
    d = start_daemon(tiny_model, tmp_path)
    with Client(d.address, timeout=120) as c:
        with pytest.raises(BenchError) as info, failing_arm("daemon"):
            run_daemon(c, [[5, 6, 7], [8, 9, 10]], 4000)
    assert str(info.value).startswith("arm daemon: a request failed: [engine_dead] "), info.value
    assert "\n" not in str(info.value)
    assert d.proc.wait(timeout=60) != 0


def _bench_args(tmp_path: Path) -> argparse.Namespace:
    args = build_parser().parse_args(["bench", "--model", "demo", "--out", str(tmp_path / "bench")])
    assert isinstance(args, argparse.Namespace)
    return args


@pytest.mark.parametrize(
    ("in_arm", "line"),
    [
        (True, "mlx-batchd bench: arm daemon: a request failed: [engine_dead] the engine died\n"),
        (False, "mlx-batchd bench: a daemon failed a call: [engine_dead] the engine died\n"),
    ],
)
def test_the_command_line_prints_one_line_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], in_arm: bool, line: str
) -> None:
    """The bench's own command, its workload replaced by one that meets a failed request: inside an
    arm's run (named), or outside any (a stats call)."""

    def workload(args: argparse.Namespace) -> int:
        if in_arm:
            with failing_arm("daemon"):
                raise RequestError("engine_dead", "the engine died")
        raise RequestError("engine_dead", "the engine died")

    monkeypatch.setattr("scheduler.bench.matrix._main", workload)
    args = _bench_args(tmp_path)
    assert args.func(args) == 1
    captured = capsys.readouterr()
    assert captured.err == line and "Traceback" not in captured.out
