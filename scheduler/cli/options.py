"""Option types and option groups that several ``mlx-batchd`` commands share.

Options are range-checked by the parser itself: a bad value is one line naming the option, the range
it accepts and what was given, exit 2, before any command runs (and before anything heavy is
imported). ``--help`` ends each option's line with its default. The groups here (client keys, probe
policy) are added by more than one command, so each is written once and the commands cannot
disagree about a flag's name, default or help.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from workers.api import ProbePolicy


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option's line with its default (``none`` where unset, ``off`` for a
    flag), unless the help itself already says what the default is."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings and action.default is not argparse.SUPPRESS:
            action = copy.copy(action)  # an option without help still gets its default shown
            action.help = self._get_help_string(action)
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        if action.default is None:
            shown = "none"
        elif action.nargs == 0 and isinstance(action.default, bool):
            shown = "on" if action.default else "off"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (the problem, then where the options are listed) instead
    of a usage block that, for ``serve``, would bury the one line that matters; its help shows every
    option's default (its sub-parsers are ``Parser`` too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

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


def chat_template_file(text: str) -> str:
    """An argparse ``type``: a Jinja chat template file (``--chat-template``), read and parsed now,
    so a missing file or a syntax error is one line before the model loads; the template's text."""
    from pathlib import Path

    import jinja2

    try:
        template = Path(text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Jinja template: line {exc.lineno}: {exc.message}"
        ) from None
    if not template.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty")
    return template


positive_int = int_in(1)
non_negative_int = int_in(0)
positive_float = float_in(0.0, above=True)
non_negative_float = float_in(0.0)
fraction = float_in(0.0, 1.0)


# ---------------------------------------------------------------------------------------------- option groups

#: The kernel levels a probe policy may pin (``workers.kernels.levels.Level``'s values, without importing MLX).
PIN_LEVELS = ("wide", "narrow", "per-query", "padded", "rowwise", "mirrored", "per-query-1")


class _Version(argparse.Action):
    """``--version``: this package's version and MLX's and mlx-lm's, read from the installed
    distributions (nothing imported), then exit 0."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(version_line())  # to stdout, where scripts read a version (argparse's exit message goes to stderr)
        parser.exit(0)


def version_line() -> str:
    """``mlx-batchd 0.1.0 (mlx 0.32.4, mlx-lm 0.32.2)``; a distribution not installed reads "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"mlx-batchd {of('mlx-batchd')} (mlx {of('mlx')}, mlx-lm {of('mlx-lm')})"


def add_version(p: argparse.ArgumentParser) -> None:
    """``mlx-batchd --version``."""
    p.add_argument("--version", action=_Version, help="print the versions of mlx-batchd, MLX and mlx-lm, and exit")


def add_client_auth(p: argparse.ArgumentParser) -> None:
    """The CURVE options of every command that talks to a daemon (``generate``, ``stats``, ``top``)."""
    p.add_argument("--curve-secret", default=None, help="your secret key file (NAME.key_secret)")
    p.add_argument("--server-key", default=None, help="the daemon's public key file")


def add_probe_policy(p: argparse.ArgumentParser) -> None:
    """The probe policy options of ``probe``. ``serve`` reads the same policy (for its start-up
    probe) from its config file's keys of the same names: a verdict is memoised with its policy, so
    both must spell the policy the same way to find each other's."""
    p.add_argument(
        "--allow-inexact",
        action="store_true",
        help="run bursts at wide even when no level is exact, marked inexact everywhere",
    )
    p.add_argument(
        "--pin-level",
        choices=PIN_LEVELS,
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
    from workers.api import Level, ProbePolicy

    return ProbePolicy(
        allow_inexact=args.allow_inexact,
        pinned_level=Level(args.pin_level) if args.pin_level else None,
        accept_classic_variation=args.accept_classic_variation,
        localize=getattr(args, "localize", False),
    )
