"""One ``/v1/messages`` answer, whole or as Anthropic's stream events, with tool use.

Without tools the answer is one text block, opened as the stream starts. With tools the answer's text
goes through ``chat_reply.Answer``: content becomes text blocks and each call a ``tool_use`` block
(``id``, ``name``, ``input``), streamed as ``content_block_start`` (with ``input: {}``), one
``input_json_delta`` holding the arguments, and ``content_block_stop``; ``stop_reason`` is
``tool_use``. A block opens when its first text or call arrives; an answer with neither has one
empty text block, as its whole form has.
"""

from __future__ import annotations

import json
from typing import Any

from scheduler.anthropic_tools import tool_use
from scheduler.chat_reply import Answer, Delta
from scheduler.stopping import StopStrings
from scheduler.tool_calls import Tools

_STOP_REASON = {"length": "max_tokens"}


def event(obj: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic sends it: its type as ``event:``, the object as ``data:``."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {obj['type']}\ndata: {data}\n\n".encode()


class Reply:
    """Builds one request's message, whole or as Anthropic's stream events."""

    def __init__(
        self,
        rid: str,
        model: str,
        input_tokens: int,
        stops: list[str],
        tokenizer: Any,
        tools: Tools | None = None,
        thinking: bool = False,
        reasoning_first: bool = False,
    ) -> None:
        """``thinking``: the model's thinking becomes thinking blocks; ``reasoning_first``: the
        prompt left a think block open."""
        self.rid, self.model, self.input_tokens, self.stops = rid, model, input_tokens, stops
        self._tokenizer, self._tools = tokenizer, tools
        self._thinking, self._reasoning_first = thinking, reasoning_first
        self.tokens: list[int] = []
        self.answer = self._new_answer()
        self._open: str | None = None  # the kind of the block the stream has open
        self._blocks = 0  # blocks the stream opened

    def _new_answer(self) -> Answer | None:
        tools = self._tools if self._tools is not None and self._tools.parse else None
        if tools is None and not self._thinking:
            return None
        return Answer(self._tokenizer, tools, self._reasoning_first, think=self._thinking, prefix="toolu_")

    def add(self, msg: dict[str, Any]) -> str:
        """A wire ``token`` message's text; its tokens are kept to tell a stop sequence at the end."""
        self.tokens += msg.get("tokens") or []
        return str(msg.get("text") or "")

    def stop(self, end: dict[str, Any], calls: bool = False) -> tuple[str, str | None]:
        """``stop_reason`` and ``stop_sequence``. The wire's ``stop`` is an EOS or a stop string:
        the stop string the daemon cut at is the first to complete in the generated text."""
        reason = str(end.get("finish_reason"))
        if reason in _STOP_REASON:
            return _STOP_REASON[reason], None
        if self.stops:
            matcher = StopStrings(self.stops)
            matcher.feed(str(self._tokenizer.decode(self.tokens)))
            if matcher.matched is not None:
                return "stop_sequence", matcher.matched
        return ("tool_use" if calls else "end_turn"), None

    def usage(self, end: dict[str, Any]) -> dict[str, int]:
        u = end.get("usage") or {}
        return {"input_tokens": int(u.get("prompt_tokens", 0)), "output_tokens": int(u.get("completion_tokens", 0))}

    def message(
        self, content: list[dict[str, Any]], stop: tuple[str | None, str | None], usage: dict[str, int]
    ) -> dict[str, Any]:
        return {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def whole(self, got: list[dict[str, Any]]) -> dict[str, Any]:
        text = "".join(self.add(msg) for msg in got[:-1])
        answer = self._new_answer()
        if answer is None:
            return self.message([{"type": "text", "text": text}], self.stop(got[-1]), self.usage(got[-1]))
        d, rest = answer.feed(text), answer.flush()
        thought = d.reasoning + rest.reasoning
        content = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
        content += [{"type": "text", "text": d.content + rest.content}] if d.content + rest.content else []
        content += [tool_use(c) for c in answer.calls]
        content = content or [{"type": "text", "text": ""}]
        return self.message(content, self.stop(got[-1], bool(answer.calls)), self.usage(got[-1]))

    # ------------------------------------------------------------------ stream

    def opening(self) -> list[bytes]:
        start = self.message([], (None, None), {"input_tokens": self.input_tokens, "output_tokens": 0})
        out = [event({"type": "message_start", "message": start})]
        if self.answer is None:
            out += self._start({"type": "text", "text": ""})
        return out + [event({"type": "ping"})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._stop_block()
        self._open = block["type"]
        out.append(event({"type": "content_block_start", "index": self._blocks, "content_block": block}))
        self._blocks += 1
        return out

    def _stop_block(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [event({"type": "content_block_stop", "index": self._blocks - 1})]

    def _text(self, text: str) -> list[bytes]:
        out = [] if self._open == "text" else self._start({"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return out + [event({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})]

    def _delta(self, d: Delta) -> list[bytes]:
        out = []
        if d.reasoning:
            if self._open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            delta = {"type": "thinking_delta", "thinking": d.reasoning}
            out.append(event({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}))
        out += self._text(d.content) if d.content else []
        for call in d.calls:
            block = {**tool_use(call), "input": {}}
            out += self._start(block)
            delta = {"type": "input_json_delta", "partial_json": call["arguments"]}
            out.append(event({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}))
            out += self._stop_block()
        return out

    def deltas(self, text: str) -> list[bytes]:
        """The events for a wire ``token`` message's text."""
        if self.answer is None:
            return self._text(text) if text else []
        return self._delta(self.answer.feed(text))

    def closing(self, end: dict[str, Any]) -> list[bytes]:
        out = self._delta(self.answer.flush()) if self.answer is not None else []
        if self._blocks == 0:
            out += self._start({"type": "text", "text": ""})
        out += self._stop_block()
        reason, sequence = self.stop(end, self.answer is not None and bool(self.answer.calls))
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        delta["usage"] = self.usage(end)
        return out + [event(delta), event({"type": "message_stop"})]
