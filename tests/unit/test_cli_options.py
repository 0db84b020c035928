"""Every numeric option of every subcommand is range-checked by the parser: a value that would give
a daemon which says ready and never answers (``--max-batch 0``, ``--prefill-step 0``,
``--max-frame-bytes 0``), or a request the daemon must refuse, is one line and exit 2."""

from __future__ import annotations

import argparse

import pytest

from scheduler.cli import build_parser
from scheduler.cli.serve import engine_settings
from scheduler.frontend import FrontEndSettings

#: (subcommand and its required arguments, option, a value out of range).
BAD = [
    (["serve"], "--max-batch", "0"),
    (["serve"], "--max-batch", "-3"),
    (["serve"], "--prefill-batch", "0"),
    (["serve"], "--prefill-step", "0"),
    (["serve"], "--max-tokens-cap", "0"),
    (["serve"], "--default-max-tokens", "-1"),
    (["serve"], "--context-length", "0"),
    (["serve"], "--max-frame-bytes", "0"),
    (["serve"], "--max-frame-bytes", "12"),
    (["serve"], "--drain-timeout", "-1"),
    (["serve"], "--drain-timeout", "nan"),
    (["serve"], "--probe-k", "0"),
    (["serve"], "-k", "0"),
    (["serve"], "--audit-fraction", "1.5"),
    (["serve"], "--audit-fraction", "-0.1"),
    (["serve"], "--max-queued", "0"),
    (["serve"], "--kv-budget-mb", "-1"),
    (["serve"], "--kv-budget-mb", "inf"),
    (["serve"], "--admit-idle-window-ms", "-1"),
    (["serve"], "--admit-idle-window-ms", "5000"),
    (["serve"], "--max-inflight-per-client", "0"),
    (["serve"], "--max-unsent-per-client", "0"),
    (["serve"], "--metrics", "9464"),
    (["probe"], "-k", "0"),
    (["probe"], "-k", "2,x"),
    (["bench-bursts"], "-k", "0"),
    (["bench-bursts"], "--ks", "2,0"),
    (["bench-bursts"], "--batch-sizes", "4,-8"),
    (["bench-bursts"], "--tokens", "0"),
    (["bench-bursts"], "--batched-tokens", "0"),
    (["bench-bursts"], "--batched-repeats", "0"),
    (["bench-bursts"], "--prompt-tokens", "0"),
    (["bench-bursts"], "--context", "0"),
    (["bench-bursts"], "--repeats", "0"),
    (["synth", "--preset", "tiny-llama", "--out", "x"], "--seed", "-1"),
    (["generate", "hi"], "--connect-timeout", "0"),
    (["generate", "hi"], "--max-tokens", "0"),
    (["generate", "hi"], "--temperature", "-0.5"),
    (["generate", "hi"], "--temperature", "nan"),
    (["generate", "hi"], "--top-p", "0"),
    (["generate", "hi"], "--top-p", "1.01"),
    (["generate", "hi"], "--top-k", "-1"),
    (["generate", "hi"], "--min-p", "2"),
    (["generate", "hi"], "--seed", "-1"),
    (["generate", "hi"], "--timeout", "0"),
    (["generate", "hi"], "--priority", "1001"),
    (["generate", "hi"], "--priority", "-1001"),
    (["stats"], "--timeout", "-1"),
    (["demo"], "--max-tokens", "0"),
    (["bench"], "--batch-sizes", "0"),
    (["bench"], "--tokens", "0"),
    (["bench"], "--prompt-tokens", "-2"),
    (["bench"], "--repeats", "0"),
    (["bench"], "--poisson-rate", "-1"),
    (["bench"], "--poisson-requests", "0"),
    (["bench"], "--poisson-tokens", "0"),
    (["bench"], "--daemon-args", '"--insecure'),
    (["serve"], "--admit-window-ms", "-1"),
    (["serve"], "--mlx-cache-limit-mb", "-5"),
    (["serve"], "--mlx-cache-limit-mb", "1e300"),
    (["serve"], "--admit-window-ms", "1e300"),
    (["top"], "--timeout", "0"),
    (["top"], "--interval", "0"),
    (["top"], "--iterations", "-1"),
]


@pytest.mark.parametrize(("command", "option", "value"), BAD, ids=[f"{c[0]} {o} {v}" for c, o, v in BAD])
def test_an_out_of_range_option_is_one_line_and_exit_2(
    command: list[str], option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([*command, option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mlx-batchd {command[0]}: argument {option}"), err
    assert value in err and f"mlx-batchd {command[0]} --help" in err


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every (nested) subcommand parser, by its full name."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found[sub.prog] = sub
                found.update(_subcommands(sub))
    return found


def _looks_numeric(value: object) -> bool:
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, int | float):
        return True
    return isinstance(value, str) and value.replace(",", "").replace(".", "").isdigit()


SUBCOMMANDS = _subcommands(build_parser())


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_no_numeric_option_is_left_unchecked(name: str) -> None:
    """An option parsed with bare ``int``/``float`` (or a numeric default and no type at all)
    accepts values the daemon cannot work with; each one gets a range-checking type."""
    unchecked = [
        action.option_strings[0]
        for action in SUBCOMMANDS[name]._actions
        if action.option_strings
        and (
            action.type in (int, float)
            or (action.type is None and action.nargs != 0 and _looks_numeric(action.default))
        )
    ]
    assert unchecked == [], f"{name}: {unchecked}"


def test_in_range_values_and_defaults_still_parse() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.max_batch, args.prefill_step, args.max_frame_bytes, args.audit_fraction) == (32, 2048, 1 << 20, 0.02)
    args = build_parser().parse_args(["serve", "--max-batch", "1", "--audit-fraction", "1", "--drain-timeout", "0"])
    assert (args.max_batch, args.audit_fraction, args.drain_timeout) == (1, 1.0, 0.0)
    assert args.max_unsent_per_client == FrontEndSettings("ipc:///x").max_unsent_per_client  # one default
    args = build_parser().parse_args(["probe", "-k", "2, 3,4"])
    assert args.k == "2,3,4"
    args = build_parser().parse_args(["generate", "hi", "--priority", "-1000", "--top-p", "1", "--seed", "0"])
    assert (args.priority, args.top_p, args.seed) == (-1000, 1.0, 0)
    args = build_parser().parse_args(["bench", "--daemon-args", "--insecure --admit-window-ms '0'"])
    assert args.daemon_args == ["--insecure", "--admit-window-ms", "0"]
    assert build_parser().parse_args(["bench", "--daemon-args=--insecure"]).daemon_args == ["--insecure"]
    args = build_parser().parse_args(["serve", "--admit-window-ms", "0", "--mlx-cache-limit-mb", "512"])
    assert (args.admit_window_ms, args.mlx_cache_limit_mb, args.admit_idle_window_ms) == (0.0, 512.0, 10.0)
    assert build_parser().parse_args(["serve", "--admit-idle-window-ms", "12.5"]).admit_idle_window_ms == 12.5
    assert engine_settings(build_parser().parse_args(["serve"])).cudnn_attention is False
    assert engine_settings(build_parser().parse_args(["serve", "--cudnn-attention"])).cudnn_attention is True
    ways = {
        way: (lambda b: (b.lookahead, b.lookahead_choice))(
            engine_settings(build_parser().parse_args(["serve", "--lookahead", way])).bursts
        )
        for way in ("auto", "on", "off")
    }
    assert ways == {"auto": (True, True), "on": (True, False), "off": (False, False)}
    assert engine_settings(build_parser().parse_args(["serve"])).bursts.lookahead_choice is True
    fused = {
        way: engine_settings(build_parser().parse_args(["serve", "--draft-in-verify", way])).bursts.draft_in_verify
        for way in ("on", "off")
    }
    assert fused == {"on": True, "off": False}
    assert engine_settings(build_parser().parse_args(["serve"])).bursts.draft_in_verify is True


def test_drafted_tokens_default_by_drafter_kind() -> None:
    """An MTP head drafts 7 a round unless told (one 8-row call of the row kernels), others 4."""
    from workers.api import DEFAULT_K, MTP_K
    from workers.api import MAX_ROWS as DENSE_ROWS
    from workers.api import MAX_ROWS as QUANT_ROWS

    def k(*argv: str) -> int:
        return engine_settings(build_parser().parse_args(["serve", *argv])).bursts.k

    assert (DEFAULT_K, MTP_K) == (4, 7)
    assert MTP_K + 1 == DENSE_ROWS == QUANT_ROWS  # the verify block is one call of either kernel
    assert k("--mtp", "demo") == MTP_K
    assert k("--draft", "prompt-lookup") == k() == DEFAULT_K
    assert k("--mtp", "demo", "-k", "3") == k("--draft", "demo", "-k", "3") == 3
