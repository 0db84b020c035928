"""The OpenAI response objects: whole completions, stream chunks, usage and logprobs.

One ``Reply`` per request builds every object that request answers with, so ids, ``created`` and
``model`` agree across a stream's chunks. Shapes follow the OpenAI API reference: ``chat.completion``
and ``chat.completion.chunk`` (``choices[].message`` / ``choices[].delta``) for chat, ``text_completion``
for completions, ``finish_reason`` ``stop`` or ``length``, ``usage`` with ``total_tokens``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

#: The wire's finish reasons that reach a successful answer, as OpenAI names them.
_FINISH = {"stop": "stop", "length": "length"}
DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event as OpenAI sends it: ``data: <compact JSON>`` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage_of(end: dict[str, Any]) -> dict[str, int]:
    u = end.get("usage") or {}
    prompt, completion = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Reply:
    """Builds the objects of one request's answer."""

    def __init__(
        self,
        *,
        chat: bool,
        rid: str,
        model: str,
        created: int,
        tokenizer: Any,
        logprobs: bool,
        include_usage: bool,
        index: int = 0,
    ) -> None:
        self.chat, self.rid, self.model, self.created = chat, rid, model, created
        #: The choice this reply builds (``n`` choices: one ``Reply`` each, all with the same ``rid``).
        self.index = index
        self._tokenizer = tokenizer
        self.logprobs = logprobs
        self.include_usage = include_usage
        self._offset = 0  # completions' text_offset: characters of token text so far

    def for_choice(self, index: int) -> Reply:
        """The same request's reply for choice ``index`` (its own text offsets)."""
        other = copy.copy(self)
        other.index, other._offset = index, 0
        return other

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def _token_text(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))

    def _top_entry(self, token: int, logprob: float) -> dict[str, Any]:
        s = self._token_text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def logprobs_of(
        self, tokens: list[int], logprobs: list[float] | None, tops: list[list[Any]] | None = None
    ) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice for these tokens (``None`` unless asked for). ``tops``: the
        wire's ``top_logprobs`` (per token ``[token_id, logprob]`` pairs, most likely first), present
        only when the request asked for some."""
        if not self.logprobs:
            return None
        lps = logprobs or []
        texts = [self._token_text(t) for t in tokens]
        if self.chat:
            rows = tops if tops is not None else [[] for _ in tokens]
            content = [
                {
                    "token": s,
                    "logprob": lp,
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [self._top_entry(t, tlp) for t, tlp in row],
                }
                for s, lp, row in zip(texts, lps, rows)
            ]
            return {"content": content, "refusal": None}
        offsets = []
        for s in texts:
            offsets.append(self._offset)
            self._offset += len(s)
        top_maps: list[dict[str, float]] | None = None
        if tops is not None:
            # Keyed by text as OpenAI's are: tokens that decode alike keep the likelier's logprob.
            top_maps = []
            for row in tops:
                m: dict[str, float] = {}
                for t, tlp in row:
                    m.setdefault(self._token_text(t), tlp)
                top_maps.append(m)
        return {"tokens": texts, "token_logprobs": list(lps), "top_logprobs": top_maps, "text_offset": offsets}

    def _choice(self, text: str, logprobs: dict[str, Any] | None, finish: str | None, chunk: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if chunk:
            delta = {"content": text} if text or finish is None else {}
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def _with_usage(self, obj: dict[str, Any], usage: dict[str, int] | None) -> dict[str, Any]:
        if self.include_usage:
            obj["usage"] = usage
        return obj

    # ------------------------------------------------------------------ streams

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role and empty content; completions have none."""
        if not self.chat:
            return None
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._with_usage({**self._head(True), "choices": [choice]}, None)

    def token_chunk(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk for a wire ``token`` message, or ``None`` when it carries nothing to show."""
        text = msg.get("text") or ""
        tokens = list(msg.get("tokens") or [])
        if not text and not (self.logprobs and tokens):
            return None
        choice = self._choice(text, self.logprobs_of(tokens, msg.get("logprobs"), msg.get("top_logprobs")), None, True)
        return self._with_usage({**self._head(True), "choices": [choice]}, None)

    def token_chunks(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks for a wire ``token`` message (a reply that splits its text may send several)."""
        chunk = self.token_chunk(msg)
        return [] if chunk is None else [chunk]

    def finish_chunks(self, end: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks that end this choice: what it still held, then the one with ``finish_reason``."""
        return [self.finish_chunk(end)]

    def final_chunks(self, end: dict[str, Any], usage: dict[str, int] | None = None) -> list[dict[str, Any]]:
        """The chunk with ``finish_reason``, then the usage chunk when ``include_usage`` (``usage``:
        the whole request's, where it is not this ``end``'s alone)."""
        out = self.finish_chunks(end)
        if self.include_usage:
            out.append({**self._head(True), "choices": [], "usage": usage or usage_of(end)})
        return out

    def finish_chunk(self, end: dict[str, Any]) -> dict[str, Any]:
        """The chunk with this choice's ``finish_reason``."""
        finish = _FINISH.get(str(end.get("finish_reason")), "stop")
        return self._with_usage({**self._head(True), "choices": [self._choice("", None, finish, True)]}, None)

    # ------------------------------------------------------------------ whole answers

    def whole(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The non-streamed answer from a request's wire messages (its tokens, then its ``end``)."""
        tokens: list[int] = []
        lps: list[float] = []
        tops: list[list[Any]] | None = None
        text = []
        for msg in messages[:-1]:
            text.append(msg.get("text") or "")
            tokens += msg.get("tokens") or []
            lps += msg.get("logprobs") or []
            if msg.get("top_logprobs") is not None:
                tops = (tops or []) + msg["top_logprobs"]
        end = messages[-1]
        finish = _FINISH.get(str(end.get("finish_reason")), "stop")
        choice = self._choice("".join(text), self.logprobs_of(tokens, lps, tops), finish, False)
        return {**self._head(False), "choices": [choice], "usage": usage_of(end)}


def usage_of_all(ends: list[dict[str, Any]]) -> dict[str, int]:
    """One request's usage over its ``n`` sequences: the prompt once, every completion token."""
    each = [usage_of(e) for e in ends]
    prompt = max((u["prompt_tokens"] for u in each), default=0)
    completion = sum(u["completion_tokens"] for u in each)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def whole_of_all(replies: list[Reply], messages: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The non-streamed answer with one choice per sequence (``messages[i]``: choice ``i``'s wire
    messages, its ``end`` last)."""
    objs = [reply.whole(msgs) for reply, msgs in zip(replies, messages)]
    return {**objs[0], "choices": [o["choices"][0] for o in objs], "usage": usage_of_all([m[-1] for m in messages])}
