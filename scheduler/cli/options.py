"""Option types and option groups that several ``mlx-batchd`` commands share.

Options are range-checked by the parser itself: a bad value is one line naming the option, the range
it accepts and what was given, exit 2, before any command runs (and before anything heavy is
imported). The groups here (client keys, probe policy) are added by more than one command, so each
is written once and the commands cannot disagree about a flag's name, default or help.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from workers.probe import ProbePolicy


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (the problem, then where the options are listed) instead
    of a usage block that, for ``serve``, would bury the one line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


# ---------------------------------------------------------------------------------------------- option types


def _span(what: str, lo: float | None, hi: float | None, above: bool = False) -> str:
    """``an integer >= 1``, ``a number in (0, 1]``: the range an option accepts, for its error."""

    def num(x: float) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"

    if lo is not None and hi is not None:
        return f"{what} in {'(' if above else '['}{num(lo)}, {num(hi)}]"
    if lo is not None:
        return f"{what} {'>' if above else '>='} {num(lo)}"
    assert hi is not None
    return f"{what} <= {num(hi)}"


def int_in(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]`` (``None``: unbounded on that side)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {_span('an integer', lo, hi)}, got {value}")
        return value

    parse.__name__ = _span("an integer", lo, hi)
    return parse


def float_in(lo: float, hi: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``[lo, hi]``, or ``(lo, hi]`` when ``above``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = value > lo if above else value >= lo
        if not (math.isfinite(value) and low_ok and (hi is None or value <= hi)):
            raise argparse.ArgumentTypeError(f"must be {_span('a number', lo, hi, above)}, got {text}")
        return value

    parse.__name__ = _span("a number", lo, hi, above)
    return parse


def int_list(lo: int = 1) -> Callable[[str], str]:
    """An argparse ``type``: a comma list of integers >= ``lo`` (``2,3,4``), kept as the text the
    commands split themselves."""

    def parse(text: str) -> str:
        items = [item.strip() for item in text.split(",")]
        try:
            values = [int(item) for item in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers (e.g. 2,3,4), got {text!r}") from None
        if any(v < lo for v in values):
            raise argparse.ArgumentTypeError(f"every item must be an integer >= {lo}, got {text!r}")
        return ",".join(str(v) for v in values)

    parse.__name__ = f"a comma list of integers >= {lo}"
    return parse


def http_address(text: str) -> str:
    """An argparse ``type``: ``HOST:PORT`` for ``--http`` (port 0 picks a free one)."""
    from scheduler.http_auth import split_host_port

    try:
        split_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None
    return text


def host_port(text: str) -> str:
    """An argparse ``type``: ``HOST:PORT`` (``:PORT`` alone means 127.0.0.1) with a port in 1..65535."""
    _, sep, port = text.rpartition(":")
    if not (sep and port.isdigit() and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:9464), got {text!r}"
        )
    return text


positive_int = int_in(1)
non_negative_int = int_in(0)
positive_float = float_in(0.0, above=True)
non_negative_float = float_in(0.0)
fraction = float_in(0.0, 1.0)


# ---------------------------------------------------------------------------------------------- option groups


def add_client_auth(p: argparse.ArgumentParser) -> None:
    """The CURVE options of every command that talks to a daemon (``generate``, ``stats``, ``top``)."""
    p.add_argument("--curve-secret", default=None, help="your secret key file (NAME.key_secret)")
    p.add_argument("--server-key", default=None, help="the daemon's public key file")


def add_probe_policy(p: argparse.ArgumentParser) -> None:
    """The probe policy options, shared by ``serve`` (its start-up probe) and ``probe``: a verdict
    is memoised with its policy, so both must spell the policy the same way to find each other's."""
    p.add_argument(
        "--allow-inexact",
        action="store_true",
        help="run bursts at wide even when no level is exact, marked inexact everywhere",
    )
    p.add_argument(
        "--pin-level",
        # workers.kernels.Level's values
        choices=["wide", "narrow", "per-query", "padded", "rowwise", "mirrored", "per-query-1"],
        default=None,
        help="use this kernel level for verify instead of the ladder's choice (padded also pins the lone "
        "sequence's classic steps)",
    )
    p.add_argument(
        "--accept-classic-variation",
        action="store_true",
        help="where classic decode itself is not reproducible, accept a block no worse than its variation",
    )


def probe_policy(args: argparse.Namespace) -> ProbePolicy:
    """The ``ProbePolicy`` the options of :func:`add_probe_policy` (and ``probe --localize``) ask for.
    Imports the workers only when called, so parsing stays free of MLX."""
    from workers.kernels import Level
    from workers.probe import ProbePolicy

    return ProbePolicy(
        allow_inexact=args.allow_inexact,
        pinned_level=Level(args.pin_level) if args.pin_level else None,
        accept_classic_variation=args.accept_classic_variation,
        localize=getattr(args, "localize", False),
    )
