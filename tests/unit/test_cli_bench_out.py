"""Where the benchmarks write when no ``--out`` is given: a folder under the directory they run in."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.cli import BENCH_OUT, build_parser


@pytest.mark.parametrize("command", ["bench", "bench-bursts"])
def test_bench_writes_to_the_current_directory_by_default(command: str) -> None:
    out = Path(build_parser().parse_args([command]).out)
    assert out == Path(BENCH_OUT) == Path("mlx-batchd-bench")  # relative: under the directory it runs in
