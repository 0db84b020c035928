"""What the front end's unit tests share: a detokenizer over a fixed vocabulary and an engine's end of
a tracked request, so the messages and the coordinator tests read the same text for the same tokens."""

from __future__ import annotations

from typing import Any

from scheduler.requests import Tracked
from workers.engine import Finished, Timings


class _Detok:
    """A detokenizer over a fixed vocabulary: each token is one piece of text."""

    def __init__(self, vocab: dict[int, str]) -> None:
        self.vocab = vocab
        self.last_segment = ""

    def add_token(self, tok: int) -> None:
        self.last_segment = self.vocab[tok]

    def finalize(self) -> None:
        self.last_segment = ""


VOCAB = {1: "Hel", 2: "lo", 3: " EN", 4: "D more", 5: "!"}


def _finished(t: Tracked, reason: str = "length", **kw: Any) -> Finished:
    return Finished(t.seq, reason, t.prompt_tokens, t.completion_tokens, Timings(0.1, 0.2, 0.3, 0.6), **kw)  # type: ignore[arg-type]
