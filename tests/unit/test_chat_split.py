"""The answer splitter (reasoning, content, tool-call text) and ``Answer`` on top of it, fed the same
text cut every possible way: the result never depends on how tokens split the markers."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.chat_reply import Answer
from scheduler.chat_split import Piece, Splitter
from scheduler.tool_calls import Tools

THINK = ("<think>", "</think>")
TOOLS = ("<tool_call>", "</tool_call>")
TEXT = (
    '<think>plan < it</think>\n\nSure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    '\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
)


def run(splitter: Splitter, parts: list[str]) -> list[tuple[str, str]]:
    pieces: list[Piece] = []
    for p in parts:
        pieces += splitter.feed(p)
    pieces += splitter.flush()
    merged: list[tuple[str, str]] = []
    for p in pieces:
        if merged and merged[-1][0] == p.kind and p.kind != "tool":
            merged[-1] = (p.kind, merged[-1][1] + p.text)
        else:
            merged.append((p.kind, p.text))
    return merged


WANT = [
    ("reasoning", "plan < it"),
    ("content", "\n\nSure."),
    ("tool", '\n{"name": "f", "arguments": {"a": 1}}\n'),
    ("content", "\n"),
    ("tool", '{"name": "g", "arguments": {}}'),
]


@pytest.mark.parametrize("cut", range(1, len(TEXT)))
def test_every_two_way_cut_splits_alike(cut: int) -> None:
    assert run(Splitter(THINK, TOOLS), [TEXT[:cut], TEXT[cut:]]) == WANT


def test_character_by_character() -> None:
    assert run(Splitter(THINK, TOOLS), list(TEXT)) == WANT


def test_markers_not_looked_for_stay_text() -> None:
    assert run(Splitter(None, None), [TEXT]) == [("content", TEXT)]
    assert run(Splitter(THINK, None), [TEXT])[1][1].startswith("\n\nSure.<tool_call>")


def test_an_answer_that_starts_inside_a_think_block() -> None:
    assert run(Splitter(THINK, None, reasoning=True), ["still thinking</think>done"]) == [
        ("reasoning", "still thinking"),
        ("content", "done"),
    ]


def test_an_unterminated_call_and_a_held_partial_marker_come_out_at_the_end() -> None:
    s = Splitter(THINK, TOOLS)
    assert s.feed("hi <tool_ca") == [Piece("content", "hi ")]
    assert s.flush() == [Piece("content", "<tool_ca")]
    s = Splitter(THINK, TOOLS)
    s.feed('<tool_call>{"name": "f"')
    assert s.flush() == [Piece("tool", '{"name": "f"', False, '<tool_call>{"name": "f"')]


class Tok:
    """The parts of mlx-lm's TokenizerWrapper that ``Answer`` reads, with the json_tools parser."""

    has_thinking = True
    think_start, think_end = THINK
    tool_call_start, tool_call_end = TOOLS

    @staticmethod
    def tool_parser(text: str, tools: Any) -> Any:
        from mlx_lm.tool_parsers.json_tools import parse_tool_call

        return parse_tool_call(text, tools)


def answer_of(parts: list[str], tools: Tools | None) -> tuple[str, str, list[tuple[str, str]]]:
    a = Answer(Tok(), tools, False)
    content = reasoning = ""
    for d in [a.feed(p) for p in parts] + [a.flush()]:
        content, reasoning = content + d.content, reasoning + d.reasoning
    return content, reasoning, [(c["name"], c["arguments"]) for c in a.calls]


@pytest.mark.parametrize("step", [1, 3, len(TEXT)])
def test_answer_parses_calls_and_keeps_interleaved_whitespace_only_with_text(step: int) -> None:
    parts = [TEXT[i : i + step] for i in range(0, len(TEXT), step)]
    content, reasoning, calls = answer_of(parts, Tools([]))
    assert (reasoning, calls) == ("plan < it", [("f", '{"a": 1}'), ("g", "{}")])
    assert content == "\n\nSure.\n"
    only_calls = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\n'
    assert answer_of([only_calls], Tools([])) == ("", "", [("f", "{}")])
    assert answer_of([only_calls], Tools([], parallel=False))[2] == [("f", "{}")]
    assert answer_of([only_calls * 2], Tools([], parallel=False))[2] == [("f", "{}")]


def test_a_call_the_parser_cannot_read_stays_text_as_written() -> None:
    bad = "<tool_call>{not json</tool_call>"
    assert answer_of([bad], Tools([])) == (bad, "", [])
    assert answer_of(["<tool_call>{not json"], Tools([])) == ("<tool_call>{not json", "", [])
    assert answer_of([bad], None) == (bad, "", [])
