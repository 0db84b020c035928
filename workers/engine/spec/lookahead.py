"""The next burst round's verify, built while this round's runs on the device.

A round builds its verify forward's graph in Python before the device can start it, a large share of
the round at ``mirrored``, while a classic step's building mlx-lm already overlaps with the previous
step's run. With greedy decoding and a drafter whose
proposal is a function of the history alone (prompt lookup), the next round's block can be guessed
before this round's result: every draft kept, and the bonus token the drafter predicts after them.
Its graph is built on the caches this round leaves, while the device computes this round, and is
launched once this round kept every draft and the guessed bonus token; it serves the next round only
when that round finds exactly that block, and otherwise the caches are put back as this round left
them and the guess's result is dropped. A launched guess is the very forward the next
round would have built (the same block on the same caches at the same level), so its outputs are the
same bytes.

A drafter that drafts from the verify's own outputs (the MTP head, from its hidden states) needs no
guess of tokens: its next proposal, if this round keeps every draft, is built on this round's
not-yet-computed hidden states and bonus token (``MTPDrafter.prepare``), and the next verify on that
proposal; both are kept when every draft is, which greedy decoding knows when this round ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from workers.api import Level
from workers.engine.spec.drafters import Drafter
from workers.engine.spec.kv_state import restore, save


@dataclass
class Ahead:
    """A guessed next round: its block, its level and its forward's logits (built, not yet used), and
    how to put the caches back: each cache's (keys, values, offset) from before the guess was built
    on them, held until the guess is launched; after that the guess's tokens are trimmed instead,
    so the held arrays do not keep MLX from updating the caches' buffers in place."""

    #: ``None`` for a block of tokens not yet known (a drafter's proposal built on this round's
    #: outputs, ``Drafter.prepare``): it is the next round's block by construction once this round
    #: keeps every draft.
    block: list[int] | None
    level: Level
    logits: mx.array
    saved: list[tuple[Any, Any, int]] | None
    #: The forward's hidden states, for drafters that need them.
    hidden: mx.array | None = None
    #: The block's length (known before its tokens are).
    tokens: int = 0
    #: For a block not yet known: the drafter's proposal in it (``[1, k]``, computed with the forward).
    drafts: mx.array | None = None

    def launch(self) -> None:
        """Start the guess on the device; from now on a wrong guess is undone by trimming its tokens
        (the same buffers, holding this round's keys and values below the trimmed offset)."""
        self.saved = None
        mx.async_eval(self.logits, *([] if self.hidden is None else [self.hidden]))

    def undo(self, cache: list[Any]) -> None:
        """Put the caches back as the round before the guess left them."""
        if self.saved is not None:
            restore(cache, self.saved)
        else:
            trim_prompt_cache(cache, self.tokens)


def plain(cache: list[Any]) -> bool:
    """Whether every cache is mlx-lm's plain growing ``KVCache``, whose whole state is (keys,
    values, offset): the only kind a guess is built on (it must be put back exactly)."""
    from mlx_lm.models.cache import KVCache

    return all(type(c) is KVCache for c in cache)


def room(cache: list[Any], tokens: int) -> bool:
    """Whether every cache holds ``tokens`` more without growing its buffer: a guess is built only
    then, so undoing it by trimming leaves each buffer as it was laid out."""
    return all(c.keys is not None and c.offset + tokens <= c.keys.shape[2] for c in cache)


def guess(drafter: Drafter, history: list[int], drafts: list[int], k: int) -> list[int] | None:
    """The next round's block if this round keeps every draft: the drafter's next token after them
    (the bonus it predicts) and its drafts after that; ``None`` when the drafter cannot say."""
    propose_after = getattr(drafter, "propose_after", None)
    if propose_after is None or not drafts:
        return None
    seen = [*history, *drafts]
    bonus = propose_after(seen, 1)
    if not bonus:
        return None
    after = propose_after([*seen, bonus[0]], k)
    return [bonus[0], *after] if after else None


def build_next(
    counted: Any, drafter: Drafter, k: int, b: Any, block: Any, level: Level, logits: mx.array, hidden: mx.array | None
) -> Ahead | None:
    """The next round's verify if this round (of burst ``b``) keeps every draft, built on ``b``'s
    caches with the target ``counted``: on a guessed block (a drafter that proposes from the history
    alone), or on the drafter's proposal built on this round's outputs (``prepare``: the MTP head).
    ``block`` is this round's (a list), or for a round whose block is not known yet its drafts
    (``[1, K]``)."""
    prepare = getattr(drafter, "prepare", None)
    if drafter.needs_hidden:
        if prepare is None or hidden is None or not room(b.cache, k + 1):
            return None
        bonus = mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)
        proposal = prepare(hidden, block if isinstance(block, mx.array) else block[1:], bonus, k)
        inputs = mx.concatenate([bonus, proposal], axis=1)
        saved = save(b.cache)
        nxt_logits, nxt_hidden = counted.with_hidden(inputs, b.cache)
        return Ahead(None, level, nxt_logits, saved, nxt_hidden, k + 1, proposal)
    nxt = guess(drafter, b.history, block[1:], k)
    if nxt is None or not room(b.cache, len(nxt)):
        return None
    saved = save(b.cache)
    return Ahead(nxt, level, counted(mx.array([nxt]), cache=b.cache), saved, None, len(nxt))
