"""``--env-arm NAME:VAR=VALUE[,VAR=VALUE]``: a daemon arm like ``daemon`` started with extra
``MLX_BATCHD_*`` variables, or serve options given as ``--OPTION=VALUE`` (``--dense-shadow=on``), to
set one engine setting against the daemon arm (a kernel path on or off, say) in the same run. Parsed
when the options are, so a bad one is refused in one line before anything loads; no MLX import."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Names an env arm cannot take: the matrix's own arms, and row keys an arm's keys would overwrite
#: (an env arm's row keys are ``NAME_tok_s``, ``NAME_spread``, ``NAME_vs_daemon``...).
RESERVED = ("raw", "engine", "daemon", "http", "ratio", "reference")
#: Lowercase letters, digits and hyphens: no underscore, so that no arm's row keys meet another's.
NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
#: The comma that starts the next ``VAR=`` or ``--OPTION=`` (a value may hold other commas,
#: ``MLX_BATCHD_TEST_FAULTS``'s do).
_NEXT_VAR = re.compile(r",(?=[A-Z][A-Z0-9_]*=|--[a-z])")
#: Serve options the bench gives every daemon itself.
_BENCH_OWN = ("--model", "--listen")


class EnvArmError(ValueError):
    """An ``--env-arm`` the bench cannot run: its message is the one line the user sees."""


@dataclass(frozen=True)
class EnvArm:
    """A daemon arm started with ``env`` on top of the bench's environment; its keys that start with
    ``--`` are serve options instead, added to the daemon arm's (``serve_args``)."""

    name: str
    env: dict[str, str]

    @property
    def variables(self) -> dict[str, str]:
        """The environment variables alone."""
        return {k: v for k, v in self.env.items() if not k.startswith("--")}

    @property
    def serve_args(self) -> list[str]:
        """The serve options alone, as command-line words."""
        return [word for k, v in self.env.items() if k.startswith("--") for word in (k, v)]


def _check_serve_option(name: str, option: str, value: str) -> None:
    """``option`` is one of serve's that takes a value (the bench's own excepted), ``value`` one it takes."""
    import argparse

    from scheduler.cli import serve
    from scheduler.cli.options import Parser

    sub = Parser(prog="mlx-batchd").add_subparsers()
    serve.add_parser(sub)
    action = sub.choices["serve"]._option_string_actions.get(option)
    if action is None or option in _BENCH_OWN or action.nargs == 0:
        raise EnvArmError(f"{name}: {option!r} is not a serve option that takes a value (see serve --help)")
    if action.choices is not None and value not in [str(c) for c in action.choices]:
        raise EnvArmError(f"{name}: {option}={value!r}: expected one of {', '.join(map(repr, action.choices))}")
    if callable(action.type):
        try:
            action.type(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise EnvArmError(f"{name}: {option}={value!r}: {exc}") from None


def parse_env_arm(text: str) -> EnvArm:
    """``NAME:VAR=VALUE[,VAR=VALUE]``, each VAR one of ``workers.envs.ALL`` and each VALUE among its
    choices (free-text variables take any), or a serve option ``--OPTION`` and a value it takes;
    ``EnvArmError`` naming what is wrong."""
    from workers import envs

    name, colon, pairs = text.partition(":")
    if not colon or not pairs:
        raise EnvArmError(f"expected NAME:VAR=VALUE[,VAR=VALUE], got {text!r}")
    if not NAME.fullmatch(name):
        raise EnvArmError(f"arm name {name!r}: use lowercase letters, digits and hyphens (e.g. mlx-kernels)")
    if name in RESERVED:
        raise EnvArmError(f"arm name {name!r} is taken by the bench's own arms ({', '.join(RESERVED)})")
    known = {v.name: v for v in envs.ALL}
    env: dict[str, str] = {}
    for pair in _NEXT_VAR.split(pairs):
        var, eq, value = pair.partition("=")
        if not eq:
            raise EnvArmError(f"{name}: expected VAR=VALUE, got {pair!r}")
        if var.startswith("--"):
            _check_serve_option(name, var, value)
        elif var not in known:
            raise EnvArmError(f"{name}: {var!r} is not an MLX_BATCHD_* variable; known: {', '.join(sorted(known))}")
        choices = known[var].choices if var in known else None
        if choices is not None and value not in choices:
            raise EnvArmError(f"{name}: {var}={value!r}: expected one of {', '.join(map(repr, choices))}")
        if var in env:
            raise EnvArmError(f"{name}: {var} given twice")
        env[var] = value
    return EnvArm(name, env)
