"""Structured output: a grammar per sequence, as a logits processor inside the batch (llguidance).

A request's ``response_format`` becomes an llguidance grammar (``grammar_text``: a JSON schema, any
JSON object, a regex or a Lark grammar); the front end checks it compiles against the model's
tokenizer (``compile_error``) before admission, and the engine gives the sequence a
``GrammarState``: a matcher, a processor that masks the row's logits to the tokens the grammar
allows, and a sampler wrapper that hands the sampled token back to the matcher.

Why llguidance (``benchmarks/grammar_mask_probe.py``, ``docs/protocol.md``): it compiles a schema
lazily (no index built over the vocabulary up front, as outlines-core does), its per-token mask is
tens of microseconds, it needs neither torch nor triton (xgrammar imports both), and it reads a
Hugging Face fast tokenizer, which every mlx-lm model has.

The mask overlaps the device step: ``BatchGenerator`` samples one step ahead, so when the processor
runs for step ``k`` the token it must consume (sampled in step ``k - 1``) is an array already queued.
The processor queues the step's forward (``mx.async_eval``, behind step ``k - 1``), reads the
token (waiting for step ``k - 1`` only) and computes the mask on the CPU while the forward runs;
the masked logits are what the sampler sees. End-of-sequence (and the request's stop ids) are allowed only where the
grammar accepts, and once the grammar is complete only they are.

A burst's verify (``workers.engine.spec.controls``) masks its rows with the same rule, position by
position: ``speculate`` advances the matcher through the block (the pending token, then the drafts,
stopping at a draft the grammar refuses), one mask per row, and ``settle`` rolls the matcher back to
the drafts the accept rule kept and hands it the token that follows them, as the batch would.
"""

from __future__ import annotations

from collections.abc import Iterable

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

from workers.engine.sampling import SeededSampler
from workers.kernels import as_int

#: A row's mask: llguidance's bitmask words and whether the request's stop ids are allowed.
RowMask = tuple[np.ndarray, bool]


def apply_bitmask(
    logits: mx.array, words: np.ndarray, extra: Iterable[int] = (), allow_extra: bool = False
) -> mx.array:
    """``logits`` ``[1, V]`` with every token whose bit is clear in ``words`` (llguidance's int32
    bitmask row) set to -inf; tokens of ``extra`` are allowed exactly when ``allow_extra``.

    The words go to the device as they are and are unpacked there: a thirty-second of the bytes a
    per-token mask would carry, and no per-token work on the host."""
    vocab = logits.shape[-1]
    w = words.view(np.uint32).copy()
    n = min(vocab, w.size * 32)
    tail = np.zeros(vocab - n, dtype=np.bool_)
    for t in extra:
        if 0 <= t < n:
            bit = np.uint32(1 << (t & 31))
            w[t >> 5] = (w[t >> 5] | bit) if allow_extra else (w[t >> 5] & ~bit)
        elif n <= t < vocab:
            tail[t - n] = allow_extra
    bits = mx.arange(32, dtype=mx.uint32)  # made here: an array belongs to the stream of its thread
    allowed = ((mx.array(w)[:, None] >> bits) & 1).reshape(-1)[:n].astype(mx.bool_)
    if tail.size:
        allowed = mx.concatenate([allowed, mx.array(tail)])
    return mx.where(allowed, logits, mx.array(-np.inf, dtype=logits.dtype))


class GrammarState:
    """One sequence's grammar: its matcher, its processor and its sampler wrapper.

    ``processor`` (also the object itself, called) consumes the token sampled last (``pending``,
    set by ``sampler``) and masks the row; ``sampler`` wraps the sequence's own sampler (``None``:
    greedy) so the token it draws is known to the processor at the next step without a new device
    op. ``speculate`` and ``settle`` do the same for a burst's verify rows.
    """

    def __init__(
        self, lltok: llguidance.LLTokenizer, grammar: str, stops: Iterable[int], sampler: SeededSampler | None
    ) -> None:
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        self.stops = frozenset(stops)
        self.inner = sampler
        #: The token to consume before the next mask: an array the sampler queued, or a burst's int.
        self.pending: mx.array | int | None = None
        self.words = np.zeros((lltok.vocab_size + 31) // 32, dtype=np.int32)
        #: Of the drafts the last ``speculate`` went through, whether the matcher consumed each.
        self._taken: list[bool] = []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return self.processor(tokens, logits)

    def sampler(self, logprobs: mx.array) -> mx.array:
        token = mx.argmax(logprobs, axis=-1) if self.inner is None else self.inner(logprobs)
        self.pending = token
        return token

    def processor(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # The step's forward is queued first (behind the previous step, still running maybe), so the
        # device never waits for the mask; the token sampled in the previous step was queued before
        # it, so reading it waits for that step only, and the mask is computed while the forward runs.
        mx.async_eval(logits)
        if self.pending is not None:
            token = self.pending if isinstance(self.pending, int) else as_int(self.pending)
            self.pending = None
            self._consume(token)
        return self.masked(logits, self._mask())

    def _consume(self, token: int) -> bool:
        """Feed ``token`` to the matcher as classic decode does (a stop token where the grammar may
        end is not fed); whether it was fed."""
        if token in self.stops and self.matcher.is_accepting():
            return False
        self.matcher.consume_token(token)
        return True

    def _mask(self) -> RowMask:
        """The next row's mask in the matcher's state (into ``words``: copy it to keep it)."""
        m = self.matcher
        if m.is_error():  # a token the grammar refused (cannot happen through this mask): end the sequence
            self.words[:] = 0
            return self.words, True
        m.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        return self.words, m.is_accepting()

    def masked(self, logits: mx.array, mask: RowMask) -> mx.array:
        """``logits`` ``[1, V]`` masked by one row's ``mask``."""
        words, allow_stops = mask
        return apply_bitmask(logits, words, self.stops, allow_stops)

    def speculate(self, block: list[int]) -> list[RowMask]:
        """The masks of a verify's rows over ``block`` (the pending token, then the drafts): row j's is
        what classic decode's processor computes after feeding ``block[: j + 1]``. A draft the
        grammar refuses ends the list (classic decode never feeds it, so no later row is reached):
        ``len(result) - 1`` drafts may be kept. The matcher is left past them, for ``settle``."""
        self.pending = None
        self._consume(block[0])
        words, allow = self._mask()
        masks: list[RowMask] = [(words.copy(), allow)]
        self._taken = []
        m = self.matcher
        for d in block[1:]:
            feed = not (d in self.stops and m.is_accepting())
            if feed and (m.is_error() or m.validate_tokens([d]) < 1):
                break
            if feed:
                m.consume_token(d)
            self._taken.append(feed)
            words, allow = self._mask()
            masks.append((words.copy(), allow))
        return masks

    def settle(self, accepted: int, next_token: int) -> None:
        """After the accept rule kept ``accepted`` drafts of the last ``speculate``: roll the matcher
        back to them and make ``next_token`` the one the next mask consumes first."""
        back = sum(self._taken[accepted:])
        if back:
            self.matcher.rollback(back)
        self._taken = []
        self.pending = next_token
