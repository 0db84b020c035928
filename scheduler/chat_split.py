"""A chat answer's text split into reasoning, content and tool-call text as it streams.

The markers are the tokenizer's own (mlx-lm's ``TokenizerWrapper``: ``think_start``/``think_end``,
``tool_call_start``/``tool_call_end``), matched on the decoded text as stop strings are
(``scheduler.stopping``): a marker split over several tokens still matches, and text that might be
the start of a marker is held back until the next text settles it, so no part of a marker reaches
a client. A tool call's text is handed over whole once its end marker arrives (the family's parser
reads whole calls); a family whose calls have no end marker (mistral's) ends them with the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTENT, REASONING, TOOL = "content", "reasoning", "tool"


@dataclass(frozen=True)
class Piece:
    """A run of text of one kind. For a tool call: the text between its markers, whether its end
    marker came (``closed``), and ``raw``, the call as the model wrote it (markers included)."""

    kind: str
    text: str
    closed: bool = True
    raw: str = ""


class Splitter:
    """Splits one answer's text. ``think``: the thinking markers (``None``: no reasoning split);
    ``tools``: the tool-call markers (``None``: calls are not looked for); ``reasoning``: the prompt
    left a think block open, so the answer starts inside it."""

    def __init__(self, think: tuple[str, str] | None, tools: tuple[str, str] | None, reasoning: bool = False) -> None:
        self._think, self._tools = think, tools
        self.state = REASONING if reasoning and think is not None else CONTENT
        self._held = ""
        self._tool: list[str] = []

    def _ends(self) -> list[str]:
        """The markers that change the current state."""
        if self.state == REASONING:
            assert self._think is not None
            return [self._think[1]]
        if self.state == TOOL:
            assert self._tools is not None
            return [self._tools[1]] if self._tools[1] else []
        return [m[0] for m in (self._think, self._tools) if m is not None and m[0]]

    def _emit(self, text: str, out: list[Piece]) -> None:
        if self.state == TOOL:
            self._tool.append(text)
        elif text:
            out.append(Piece(self.state, text))

    def _switch(self, marker: str, out: list[Piece]) -> None:
        if self.state == REASONING:
            self.state = CONTENT
        elif self.state == TOOL:
            assert self._tools is not None
            text = "".join(self._tool)
            self._tool = []
            out.append(Piece(TOOL, text, True, self._tools[0] + text + marker))
            self.state = CONTENT
        elif self._think is not None and marker == self._think[0]:
            self.state = REASONING
        else:
            self.state = TOOL

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` completes (adjacent ones of a kind are not merged)."""
        out: list[Piece] = []
        buf = self._held + text
        while True:
            ends = self._ends()
            hits = [(i, -len(m), m) for m in ends if (i := buf.find(m)) >= 0]
            if not hits:
                break
            index, _, marker = min(hits)
            self._emit(buf[:index], out)
            self._switch(marker, out)
            buf = buf[index + len(marker) :]
        keep = 0
        for m in self._ends():
            for k in range(min(len(m) - 1, len(buf)), keep, -1):
                if buf.endswith(m[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :]
        self._emit(buf[: len(buf) - keep], out)
        return out

    def flush(self) -> list[Piece]:
        """What is left once the answer ended: held text, and a tool call its end never closed."""
        out: list[Piece] = []
        held, self._held = self._held, ""
        self._emit(held, out)
        if self.state == TOOL:
            assert self._tools is not None
            text = "".join(self._tool)
            self._tool = []
            out.append(Piece(TOOL, text, False, self._tools[0] + text))
            self.state = CONTENT
        return out
