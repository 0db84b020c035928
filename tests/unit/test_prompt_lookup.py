"""Prompt lookup's proposals: which earlier occurrence of the last n-gram it copies from."""

from __future__ import annotations

import pytest

from workers.engine.spec.drafters import PromptLookup


@pytest.mark.parametrize(
    ("history", "want"),
    [
        ([5, 6, 9, 9, 9, 9, 9, 9, 9, 9], [9, 9, 9, 9]),  # a repeated token: k tokens, not the one after the last 9
        ([3, 1, 2, 1, 2, 1, 2, 1, 2], [1, 2, 1, 2]),  # a loop shorter than k
        ([1, 2, 7, 7, 7, 7, 1, 2, 8, 8, 8, 8, 1, 2], [8, 8, 8, 8]),  # the most recent full match wins
        ([1, 2, 3, 1, 2], [3, 1, 2]),  # no occurrence followed by k tokens: the one followed by the most
        ([4, 5, 6], []),  # nothing recurs
    ],
)
def test_proposal_copies_k_tokens_where_the_history_has_them(history: list[int], want: list[int]) -> None:
    assert PromptLookup().propose_after(history, 4) == want


def test_longest_ngram_is_tried_first() -> None:
    # the 1-gram [2] last occurs at index 4 (followed by 9s); the 3-gram [1, 1, 2] only at index 0
    history = [1, 1, 2, 5, 2, 9, 9, 9, 9, 1, 1, 2]
    assert PromptLookup().propose_after(history, 4) == [5, 2, 9, 9]
