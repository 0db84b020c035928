"""Stop strings, matched on decoded text rather than token ids.

A stop string can be split across tokens in many ways, so matching token sequences (as mlx-lm's
``StopSequences`` does for stop tokens) misses some; matching text does not. Text that might be
the start of a stop string is held back until the next token settles it, so a client never sees
part of a stop string.
"""

from __future__ import annotations


class StopStrings:
    """Streams text through, cutting it before the first stop string to complete."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Return the text that is safe to emit and whether a stop string completed."""
        if self.matched is not None:
            return "", True
        buf = self._held + text
        # The stop string that completes first as the text streams in (the earliest end; of two
        # ending together, the longer), so the cut does not depend on how tokens split the text.
        hits = [(i + len(s), i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            _, index, stop = min(hits)
            self.matched = stop
            self._held = ""
            return buf[:index], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, once the sequence ended without completing a stop string."""
        held, self._held = self._held, ""
        return held
