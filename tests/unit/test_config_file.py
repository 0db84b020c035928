"""``serve --config FILE.toml``: every setting is a key, the file is checked like the options (an
unknown key or a wrong type is one line naming the key), an option given on the command line wins
over the file, docs/configuration.md lists every key with its default, and ``--help`` shows every
option's default."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from scheduler.cli import build_parser
from scheduler.cli.config_file import ConfigFileError, Key, apply, keys_of
from scheduler.cli.serve import engine_settings
from scheduler.cli.serve_keys import FILE_KEYS

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


SERVE = _subcommands()["serve"]
KEYS = keys_of(SERVE, FILE_KEYS)


def _serve(tmp_path: Path, toml: str, *argv: str) -> argparse.Namespace:
    """``serve``'s settings from a config file holding ``toml`` and the options ``argv``."""
    path = tmp_path / "serve.toml"
    path.write_text(toml)
    args = build_parser().parse_args(["serve", "--config", str(path), *argv])
    apply(args, KEYS)
    return args


def _refusal(tmp_path: Path, toml: str) -> str:
    with pytest.raises(ConfigFileError) as info:
        _serve(tmp_path, toml)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'serve.toml'}: "), message
    return message


def test_a_file_setting_replaces_the_default(tmp_path: Path) -> None:
    args = _serve(tmp_path, 'admit_window_ms = 5\nlookahead = "off"\nmax_batch = 8\nallow_inexact = true\n')
    assert (args.admit_window_ms, args.lookahead, args.max_batch, args.allow_inexact) == (5.0, "off", 8, True)
    assert isinstance(args.admit_window_ms, float)  # an integer is a number where a number is asked
    engine = engine_settings(args)
    assert (engine.admit_window_s, engine.max_batch, engine.bursts.lookahead) == (0.005, 8, False)
    assert engine.probe_policy.allow_inexact is True


def test_the_command_line_wins_over_the_file_even_with_the_default_value(tmp_path: Path) -> None:
    """``--max-batch 32`` is the default's value, but it was given: the file's 8 must not replace it."""
    args = _serve(
        tmp_path, "max_batch = 8\nmax_queued = 7\ncudnn_attention = true\n", "--max-batch", "32", "--insecure"
    )
    assert (args.max_batch, args.max_queued, args.cudnn_attention, args.insecure) == (32, 7, True, True)
    args = _serve(tmp_path, "insecure = false\nadmit_window_ms = 5.0\n", "--insecure", "--admit-window-ms", "0")
    assert (args.insecure, args.admit_window_ms) == (True, 0.0)  # a hidden alias wins too


def test_no_config_leaves_the_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    apply(args, KEYS)
    assert {name: getattr(args, name) for name in KEYS} == {name: key.default for name, key in KEYS.items()}


@pytest.mark.parametrize(
    ("toml", "needles"),
    [
        ("max_btach = 4", ["unknown key 'max_btach'", "did you mean 'max_batch'?", "docs/configuration.md"]),
        ("[engine]\nmax_batch = 4", ["unknown key 'engine'"]),
        ("config = 'other.toml'", ["unknown key 'config'"]),
        ('max_batch = "4"', ["max_batch: expected an integer, got string '4'"]),
        ("max_batch = 4.0", ["max_batch: expected an integer, got number 4.0"]),
        ("max_batch = true", ["max_batch: expected an integer, got boolean true"]),
        ("max_batch = 0", ["max_batch: must be an integer >= 1, got 0"]),
        ("park_after = true", ["park_after: expected a number, got boolean true"]),
        ("audit_fraction = 1.5", ["audit_fraction: must be a number in [0, 1], got 1.5"]),
        ("insecure = 1", ["insecure: expected true or false, got integer 1"]),
        ("cudnn_attention = 'yes'", ["cudnn_attention: expected true or false, got string 'yes'"]),
        ("lookahead = 'maybe'", ["lookahead: expected one of auto, on, off, got 'maybe'"]),
        ("pin_level = 'sideways'", ["pin_level: expected one of wide, narrow"]),
        ("log_level = 'loud'", ["log_level: expected one of debug, info, warning, error"]),
        ("metrics = '9464'", ["metrics: expected HOST:PORT"]),
        ("model = ['a']", ["model: expected a string, got array"]),
        ("max_frame_bytes = 12", ["max_frame_bytes: must be an integer in [1024, 1073741824], got 12"]),
        ("max_batch =", ["not valid TOML"]),
    ],
)
def test_a_bad_file_is_one_line_naming_the_key(tmp_path: Path, toml: str, needles: list[str]) -> None:
    message = _refusal(tmp_path, toml + "\n")
    for needle in needles:
        assert needle in message, message


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--config", str(tmp_path / "nope.toml")])
    with pytest.raises(ConfigFileError, match=r"^--config .*nope\.toml: no such file$"):
        apply(args, KEYS)


def test_every_option_of_serve_is_a_key_and_the_file_only_keys_leave_help() -> None:
    options = {a.dest for a in SERVE._actions if a.option_strings and a.help != argparse.SUPPRESS}
    assert options - {"help", "config"} <= set(KEYS)
    shown = SERVE.format_help()
    for key in FILE_KEYS:
        assert key.option not in shown, key.option
    probe = _subcommands()["probe"].format_help()
    for option in ("--allow-inexact", "--pin-level", "--accept-classic-variation"):  # the probe's own options
        assert option not in shown and option in probe


def test_serve_keeps_a_short_command_line() -> None:
    """The operator's options only: the rest belong in the config file (docs/configuration.md)."""
    visible = [a.option_strings[0] for a in SERVE._actions if a.option_strings and a.help != argparse.SUPPRESS]
    assert len(visible) - 1 <= 22, visible  # less --help


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _documented() -> dict[str, tuple[str, str]]:
    """docs/configuration.md's rows: key -> (type, default)."""
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", DOC.read_text(), flags=re.M)
    names = [name for name, _, _ in rows]
    assert len(names) == len(set(names)), names
    return {name: (kind.strip(), default.strip()) for name, kind, default in rows}


def test_the_documentation_lists_every_key_with_its_default() -> None:
    documented = _documented()
    assert set(documented) == set(KEYS)
    for name, key in KEYS.items():
        _, default = documented[name]
        if key.default is None:
            assert default.startswith("unset"), (name, default)
        else:
            assert default == f"`{_toml(key.default)}`", (name, default)


def test_the_documentation_gives_each_key_its_type() -> None:
    documented = _documented()
    for name, key in KEYS.items():
        kind, _ = documented[name]
        if key.choices is not None:
            assert kind == ", ".join(f'`"{c}"`' for c in key.choices), (name, kind)
        else:
            word = {bool: "true/false", int: "integer", float: "number", str: "string"}[key.kind]
            assert kind.startswith(word), (name, kind)


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_help_shows_every_default(name: str) -> None:
    """Each option's help says its default (argparse's own help would leave most of them out)."""
    parser = _subcommands()[name]
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.default is argparse.SUPPRESS or action.help == argparse.SUPPRESS:
            continue
        text = parser._get_formatter()._format_action(action)
        if "default" not in text.lower():
            missing.append(action.option_strings[0])
    assert missing == [], f"{name}: {missing}"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out == f"mlx-batchd {version('mlx-batchd')} (mlx {version('mlx')}, mlx-lm {version('mlx-lm')})\n"


def test_a_key_is_range_checked_by_its_option_type() -> None:
    """``Key``'s checks on their own: an integer key's range comes from its option type."""
    from scheduler.cli.config_file import check
    from scheduler.cli.options import positive_int

    key = Key("n", int, 1, "", positive_int)
    assert check(key, 3) == 3
    with pytest.raises(ValueError, match="must be an integer >= 1, got -2"):
        check(key, -2)
