"""A command's ``--config FILE.toml``: its keys, how the file is read and checked, and how it meets
the command line.

Every option a command has on its command line is also a key of the file (the option's name with
``_`` for ``-``: ``--max-batch`` is ``max_batch``), and the settings an operator rarely changes are
keys only (:class:`Key`). A value given on the command line wins over the file's, the file's over
the default. The file is checked like the options: a key the command does not know, a value of the
wrong type or out of range is one line naming the key, exit 2, before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The namespace attribute listing the options given on the command line (by destination).
GIVEN = "cli_given"
#: Destinations that are not settings.
_NOT_KEYS = frozenset({"help", "config", "version", "func", "command", GIVEN})


class ConfigFileError(Exception):
    """A config file that cannot be used; the message is one line naming the file and the key."""


@dataclass(frozen=True)
class Key:
    """One setting of the config file.

    ``kind`` is the TOML type it takes (``bool``, ``int``, ``float`` or ``str``); ``parse`` the
    option type that range-checks it (text in, value out), ``choices`` the strings it may be.
    ``alias`` keeps it accepted, hidden from ``--help``, as the option ``--NAME-WITH-DASHES`` (for
    scripts written before it became a key of the file)."""

    name: str
    kind: type
    default: Any
    help: str
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    alias: bool = False

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


# ---------------------------------------------------------------------------------------------- the parser side


def _given(namespace: argparse.Namespace) -> set[str]:
    given: set[str] | None = getattr(namespace, GIVEN, None)
    if given is None:
        given = set()
        setattr(namespace, GIVEN, given)
    return given


class _Store(argparse._StoreAction):
    """``store`` that also notes that the option was given (so a config file does not override it)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _given(namespace).add(self.dest)


class _StoreTrue(argparse._StoreTrueAction):
    """``store_true`` that also notes that the option was given."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _given(namespace).add(self.dest)


def track_given(parser: argparse.ArgumentParser) -> None:
    """Make the options added to ``parser`` from now on note when they are given, so that
    :func:`apply` lets the command line win over the file. Call before adding the options."""
    parser.register("action", None, _Store)
    parser.register("action", "store", _Store)
    parser.register("action", "store_true", _StoreTrue)


def add_keys(parser: argparse.ArgumentParser, keys: Iterable[Key]) -> None:
    """Give ``parser`` the file-only keys: their defaults, and the hidden option of an ``alias``."""
    for key in keys:
        if key.alias:
            if key.kind is bool:
                parser.add_argument(key.option, dest=key.name, action="store_true", help=argparse.SUPPRESS)
            else:
                parser.add_argument(
                    key.option, dest=key.name, type=key.parse or str, choices=key.choices, help=argparse.SUPPRESS
                )
        parser.set_defaults(**{key.name: key.default})


def _kind(action: argparse.Action) -> type:
    """The TOML type an option takes: what its type function parses (``options.int_in`` and
    ``float_in`` name theirs "an integer ..." and "a number ...")."""
    if action.nargs == 0:
        return bool
    name = getattr(action.type, "__name__", "")
    if name.startswith("an integer"):
        return int
    if name.startswith("a number"):
        return float
    return str


def keys_of(parser: argparse.ArgumentParser, file_only: Iterable[Key]) -> dict[str, Key]:
    """Every key a command's config file may hold: its options, then its file-only keys."""
    keys: dict[str, Key] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in _NOT_KEYS:
            continue
        choices = tuple(str(c) for c in action.choices) if action.choices is not None else None
        parse = action.type if callable(action.type) else None
        keys[action.dest] = Key(action.dest, _kind(action), action.default, action.help or "", parse, choices)
    for key in file_only:
        keys[key.name] = key
    return keys


# ---------------------------------------------------------------------------------------------- the file side

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _describe(value: Any) -> str:
    """How a wrong value reads in a message: its TOML type and the value."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "table"}
    what = next((n for t, n in names.items() if type(value) is t), type(value).__name__)
    if isinstance(value, dict | list):
        return what
    return f"{what} {str(value).lower() if isinstance(value, bool) else repr(value)}"


def check(key: Key, value: Any) -> Any:
    """``value`` (as TOML read it) for ``key``, converted to what the option would hold; raises
    ``ValueError`` with what is wrong."""
    numeric = key.kind in (int, float) and isinstance(value, int | float) and not isinstance(value, bool)
    if not (type(value) is key.kind or (key.kind is float and numeric)):
        raise ValueError(f"expected {_TYPE_NAMES[key.kind]}, got {_describe(value)}")
    if key.kind is float:
        value = float(value)
    if key.choices is not None and str(value) not in key.choices:
        raise ValueError(f"expected one of {', '.join(key.choices)}, got {value!r}")
    if key.parse is not None and key.kind is not bool:
        try:
            value = key.parse(str(value))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None
    return value


def load(path: str | Path, keys: dict[str, Key]) -> dict[str, Any]:
    """The settings a config file holds, each checked; raises ``ConfigFileError`` (one line)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigFileError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path}: not valid TOML: {exc}") from None
    settings: dict[str, Any] = {}
    for name, value in data.items():
        key = keys.get(name)
        if key is None:
            close = difflib.get_close_matches(name, keys, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigFileError(f"{path}: unknown key {name!r} ({hint}docs/configuration.md lists every key)")
        try:
            settings[name] = check(key, value)
        except ValueError as exc:
            raise ConfigFileError(f"{path}: {name}: {exc}") from None
    return settings


def apply(args: argparse.Namespace, keys: dict[str, Key]) -> None:
    """Read ``args.config`` (when given) into ``args``: each of its settings not given on the
    command line replaces the default. Raises ``ConfigFileError``."""
    path = getattr(args, "config", None)
    if path is None:
        return
    given: set[str] = getattr(args, GIVEN, set())
    for name, value in load(path, keys).items():
        if name not in given:
            setattr(args, name, value)
