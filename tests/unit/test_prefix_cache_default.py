"""``serve``'s prefix-cache default: on alone, a share of a KV budget, off with 0, and off under a
launcher, where only a bound the user gave is refused."""

from __future__ import annotations

import pytest

from scheduler.cli import build_parser
from scheduler.cli.serve import DEFAULT_PREFIX_CACHE_MB, check_ranks, engine_settings

MIB = 2**20


def _bound(*argv: str) -> int:
    return engine_settings(build_parser().parse_args(["serve", *argv])).prefix_cache_bytes


@pytest.fixture(autouse=True)
def not_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_the_prefix_cache_is_on_by_default_and_fits_the_kv_budget() -> None:
    assert _bound() == int(DEFAULT_PREFIX_CACHE_MB * MIB)
    assert _bound("--kv-budget-mb", "100") == 25 * MIB  # a quarter of the budget, the rest for requests
    assert _bound("--kv-budget-mb", "100000") == int(DEFAULT_PREFIX_CACHE_MB * MIB)
    assert _bound("--prefix-cache-mb", "0") == 0
    assert _bound("--prefix-cache-mb", "3", "--kv-budget-mb", "100") == 3 * MIB


def test_under_a_launcher_the_default_is_off_and_only_a_given_bound_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workers.dist import DistributedError

    monkeypatch.setenv("MLX_RANK", "0")
    args = build_parser().parse_args(["serve"])
    assert engine_settings(args).prefix_cache_bytes == 0
    check_ranks(args)  # the default is not refused
    check_ranks(build_parser().parse_args(["serve", "--prefix-cache-mb", "0"]))
    with pytest.raises(DistributedError, match="--prefix-cache-mb cannot serve across ranks"):
        check_ranks(build_parser().parse_args(["serve", "--prefix-cache-mb", "8"]))
