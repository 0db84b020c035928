"""``--env-arm NAME:VAR=VALUE[,VAR=VALUE]``: a daemon arm like ``daemon`` started with extra
``MLX_BATCHD_*`` variables, to set one engine setting against the daemon arm (a kernel path on or
off, say) in the same run. Parsed when the options are, so a bad one is refused in one line before
anything loads; no MLX import."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Names an env arm cannot take: the matrix's own arms, and row keys an arm's keys would overwrite
#: (an env arm's row keys are ``NAME_tok_s``, ``NAME_spread``, ``NAME_vs_daemon``...).
RESERVED = ("raw", "engine", "daemon", "http", "ratio", "reference")
#: Lowercase letters, digits and hyphens: no underscore, so that no arm's row keys meet another's.
NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
#: The comma that starts the next ``VAR=`` (a value may hold commas, ``MLX_BATCHD_TEST_FAULTS``'s do).
_NEXT_VAR = re.compile(r",(?=[A-Z][A-Z0-9_]*=)")


class EnvArmError(ValueError):
    """An ``--env-arm`` the bench cannot run: its message is the one line the user sees."""


@dataclass(frozen=True)
class EnvArm:
    """A daemon arm started with ``env`` on top of the bench's environment."""

    name: str
    env: dict[str, str]


def parse_env_arm(text: str) -> EnvArm:
    """``NAME:VAR=VALUE[,VAR=VALUE]``, each VAR one of ``workers.envs.ALL`` and each VALUE among its
    choices (free-text variables take any); ``EnvArmError`` naming what is wrong."""
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
        if var not in known:
            raise EnvArmError(f"{name}: {var!r} is not an MLX_BATCHD_* variable; known: {', '.join(sorted(known))}")
        choices = known[var].choices
        if choices is not None and value not in choices:
            raise EnvArmError(f"{name}: {var}={value!r}: expected one of {', '.join(map(repr, choices))}")
        if var in env:
            raise EnvArmError(f"{name}: {var} given twice")
        env[var] = value
    return EnvArm(name, env)
