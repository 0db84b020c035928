"""How many prompts one prefill wave takes: as many as fit a token budget, not a fixed count.

Why: mlx-lm's ``BatchGenerator`` prefills at most ``prefill_batch_size`` prompts together (8 in
``mlx_lm.server``), and every further group joins the decode batch a couple of steps later. When
many requests arrive together the batch then decodes in waves (64 prompts: 8 waves of 8), taking
more decode steps than the tokens need, and its sequences finish in as many steps, each one
filtering every layer's cache. A count is also the wrong bound for memory and for the decoding
batch's stall: 8 prompts of 2,048 tokens make a 16,384-token chunk, 8 of 30 tokens a 240-token one.

So a wave takes the queued prompts in arrival order while (prompts x the longest chunk among them)
stays within ``budget`` tokens (``prefill_tokens``), at least one prompt and at most ``most``
(``prefill_batch``, by default the decode batch's size). A prompt's chunk is what mlx-lm feeds
it in one prefill step: its remaining tokens, at most ``prefill_step``.
"""

from __future__ import annotations


def most_prompts(prefill_batch: int | None, max_batch: int) -> int:
    """The most prompts one wave prefills: ``prefill_batch`` (unset: the decode batch's size),
    never more than the decode batch holds."""
    return max_batch if prefill_batch is None else min(prefill_batch, max_batch)


def wave_size(prefilling: list[int], queued: list[int], most: int, budget: int, step: int) -> int:
    """The prompt batch size for the next prefill step: the prompts already prefilling
    (``prefilling``: their remaining tokens) and as many of ``queued`` (in order) as fit
    ``budget``; never fewer than one, never more than ``most`` (unless more are already prefilling)."""
    n = len(prefilling)
    longest = max((min(t, step) for t in prefilling), default=0)
    for tokens in queued:
        chunk = max(longest, min(tokens, step))
        if n >= most or (n > 0 and (n + 1) * chunk > budget):
            break
        n, longest = n + 1, chunk
    return max(n, 1)
