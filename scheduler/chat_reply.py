"""Chat answers with reasoning and tool calls, in the OpenAI API's shapes.

``Answer`` turns one choice's text into reasoning (``reasoning_content``), content and tool calls
(``scheduler.chat_split`` finds them, ``scheduler.tool_calls`` parses them); ``SplitReply`` is the
``http_shapes.Reply`` that sends them: whole, ``message.reasoning_content`` and ``message.tool_calls``
(``[{id, type: function, function: {name, arguments}}]``, ``content`` null when the answer is only
calls, ``finish_reason`` ``tool_calls``); streamed, ``delta.reasoning_content``, ``delta.content``,
and per call a delta with its ``index``, ``id``, ``type`` and function name, then one with its
arguments. A call is sent once its end marker arrives. Whitespace alone in the content is held back
until more content comes: an answer that turns out to be only calls has no content, streamed or whole.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from scheduler.chat_split import REASONING, TOOL, Splitter
from scheduler.http_shapes import _FINISH, Reply
from scheduler.tool_calls import Tools, parse_call


@dataclass
class Delta:
    """What one piece of text adds to an answer."""

    reasoning: str = ""
    content: str = ""
    #: New calls: ``{"id", "name", "arguments"}``.
    calls: list[dict[str, Any]] = field(default_factory=list)


class Answer:
    """One choice's answer text, split as it arrives."""

    def __init__(
        self, tokenizer: Any, tools: Tools | None, reasoning_first: bool, *, think: bool = True, prefix: str = "call_"
    ) -> None:
        """``think``: split reasoning off where the tokenizer has thinking markers; ``prefix``: of
        the ids given to calls."""
        self._tokenizer, self._tools, self._prefix = tokenizer, tools, prefix
        self.thinks = think and bool(getattr(tokenizer, "has_thinking", False))
        markers = (str(tokenizer.think_start), str(tokenizer.think_end)) if self.thinks else None
        marks = None
        if tools is not None and tools.parse:
            marks = (str(tokenizer.tool_call_start), str(tokenizer.tool_call_end or ""))
        self._split = Splitter(markers, marks, reasoning_first)
        self.calls: list[dict[str, Any]] = []
        self._said = False  # content other than whitespace went out
        self._spaces = ""  # whitespace content held back

    def _take(self, pieces: list[Any], delta: Delta) -> Delta:
        for p in pieces:
            if p.kind == REASONING:
                delta.reasoning += p.text
                continue
            text = p.text
            if p.kind == TOOL:
                calls = parse_call(self._tokenizer, p.text, self._tools.tools if self._tools else None, self._prefix)
                if calls is not None:
                    if self._tools is not None and not self._tools.parallel:
                        calls = calls[: max(0, 1 - len(self.calls))]
                    self.calls += calls
                    delta.calls += calls
                    continue
                text = p.raw  # a call the parser cannot read stays text, as the model wrote it
            if text.strip():
                delta.content += self._spaces + text
                self._spaces, self._said = "", True
            else:
                self._spaces += text
        return delta

    def feed(self, text: str) -> Delta:
        return self._take(self._split.feed(text), Delta())

    def flush(self) -> Delta:
        delta = self._take(self._split.flush(), Delta())
        if self._spaces and (self._said or not self.calls):
            delta.content += self._spaces
        self._spaces = ""
        return delta


def finish_of(end: dict[str, Any], calls: bool) -> str:
    finish = _FINISH.get(str(end.get("finish_reason")), "stop")
    return "tool_calls" if calls and finish == "stop" else finish


class SplitReply(Reply):
    """A chat ``Reply`` whose text goes through an ``Answer``."""

    def __init__(self, *, tools: Tools | None, reasoning_first: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tools, self.reasoning_first = tools, reasoning_first
        self.answer = self._new_answer()

    def _new_answer(self) -> Answer:
        return Answer(self._tokenizer, self.tools, self.reasoning_first)

    def for_choice(self, index: int) -> Reply:
        other = copy.copy(super().for_choice(index))
        assert isinstance(other, SplitReply)
        other.answer = other._new_answer()
        return other

    def _chunk(self, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._with_usage({**self._head(True), "choices": [choice]}, None)

    def _delta_chunks(self, d: Delta) -> list[dict[str, Any]]:
        out = []
        if d.reasoning:
            out.append(self._chunk({"reasoning_content": d.reasoning}))
        if d.content:
            out.append(self._chunk({"content": d.content}))
        first = len(self.answer.calls) - len(d.calls)
        for i, call in enumerate(d.calls, first):
            head = {"index": i, "id": call["id"], "type": "function"}
            head["function"] = {"name": call["name"], "arguments": ""}
            out.append(self._chunk({"tool_calls": [head]}))
            out.append(self._chunk({"tool_calls": [{"index": i, "function": {"arguments": call["arguments"]}}]}))
        return out

    def token_chunks(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._delta_chunks(self.answer.feed(str(msg.get("text") or "")))
        tokens = list(msg.get("tokens") or [])
        if self.logprobs and tokens:
            lps = self.logprobs_of(tokens, msg.get("logprobs"), msg.get("top_logprobs"))
            if not out:
                out.append(self._chunk({"content": ""}))
            out[0]["choices"][0]["logprobs"] = lps
        return out

    def finish_chunks(self, end: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._delta_chunks(self.answer.flush())
        return out + [self._chunk({}, None, finish_of(end, bool(self.answer.calls)))]

    def whole(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        obj = super().whole(messages)
        choice = obj["choices"][0]
        answer = self._new_answer()
        d = answer.feed(choice["message"]["content"])
        rest = answer.flush()
        content, reasoning = d.content + rest.content, d.reasoning + rest.reasoning
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if answer.thinks:
            message["reasoning_content"] = reasoning or None
        if answer.calls:
            message["content"] = content or None
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in answer.calls
            ]
        choice["message"] = message
        choice["finish_reason"] = finish_of(messages[-1], bool(answer.calls))
        return obj
