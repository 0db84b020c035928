"""A request's logits controls on a burst's verify rows, position by position.

Classic decode runs a sequence's logits processors (``workers.engine.logits_controls``: penalties,
bias, ``min_tokens``) and then its grammar mask (``workers.engine.grammar_mask``) on each step's
row, given the tokens in its cache plus the one being fed. Verify row j is the step that feeds
``block[j]`` (the pending token, then the drafts), so it gets the same processors over the history
extended by the drafts before it, and the grammar's mask with the matcher advanced through them.
Wherever the drafts before row j are what classic decode emitted, which is all the accept rule reads,
row j is then classic decode's row. A draft the grammar refuses ends the rows (classic decode never
feeds it), and after the accept rule the matcher is rolled back to the kept drafts (``settle``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from workers.engine.grammar_mask import GrammarState
from workers.engine.sampling import SeededSampler


class Controls:
    """One bursting sequence's processors and grammar, as its verify applies them."""

    def __init__(self, processors: list[Any]) -> None:
        self.processors = [p for p in processors if not isinstance(p, GrammarState)]
        grammars = [p for p in processors if isinstance(p, GrammarState)]
        self.grammar: GrammarState | None = grammars[0] if grammars else None

    @property
    def active(self) -> bool:
        """Whether the verify's rows need anything done to them."""
        return bool(self.processors) or self.grammar is not None

    def sampler(self, sampler: Any) -> SeededSampler | None:
        """The sampler a burst draws with: the sequence's own, under its grammar's wrapper if any
        (the wrapper only tells the batch's next mask what was drawn; ``settle`` does that here)."""
        return self.grammar.inner if self.grammar is not None else sampler

    def apply(self, history: list[int], block: list[int], logits: mx.array) -> mx.array:
        """Verify rows ``logits`` ``[len(block), V]`` as classic decode would see them; ``history``
        is the tokens in the cache before the block, then ``block[0]`` (the pending token). Fewer
        rows come back when the grammar refuses a draft: the last row is the refused draft's (it
        gives the draft no mass), and rows past it, never classic decode's, are dropped."""
        masks = None if self.grammar is None else self.grammar.speculate(block)
        n = len(block) if masks is None else len(masks)
        if self.processors:
            fed = mx.array([*history, *block[1:n]], dtype=mx.int32)
        rows = []
        for j in range(n):
            row = logits[j : j + 1]
            if self.processors:
                context = fed[: len(history) + j]  # what classic decode's processors see at this step
                for p in self.processors:
                    row = p(context, row)
            if masks is not None:
                assert self.grammar is not None
                row = self.grammar.masked(row, masks[j])
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def settle(self, accepted: int, next_token: int) -> None:
        """The accept rule kept ``accepted`` drafts and chose ``next_token`` after them."""
        if self.grammar is not None:
            self.grammar.settle(accepted, next_token)
