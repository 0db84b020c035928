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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

from workers.kernels import as_int

#: The reason a sequence with a grammar is declined bursts (their verify applies no mask).
DECLINE_REASON = "grammar"


def apply_bitmask(
    logits: mx.array, words: np.ndarray, extra: Iterable[int] = (), allow_extra: bool = False
) -> mx.array:
    """``logits`` ``[1, V]`` with every token whose bit is clear in ``words`` (llguidance's int32
    bitmask row) set to -inf; tokens of ``extra`` are allowed exactly when ``allow_extra``."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    allowed = np.zeros(vocab, dtype=np.bool_)
    n = min(vocab, bits.size)
    allowed[:n] = bits[:n]
    for t in extra:
        if 0 <= t < vocab:
            allowed[t] = allow_extra
    return mx.where(mx.array(allowed), logits, mx.array(-np.inf, dtype=logits.dtype))


class GrammarState:
    """One sequence's grammar: its matcher, its processor and its sampler wrapper.

    ``processor`` consumes the token sampled last (``pending``, set by ``sampler``) and masks the
    row; ``sampler`` wraps the sequence's own sampler (``None``: greedy) so the token it draws is
    known to the processor at the next step without a new device op.
    """

    def __init__(
        self, lltok: llguidance.LLTokenizer, grammar: str, stops: Iterable[int], sampler: Callable[..., Any] | None
    ) -> None:
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        self.stops = frozenset(stops)
        self.inner = sampler
        self.pending: mx.array | None = None
        self.words = np.zeros((lltok.vocab_size + 31) // 32, dtype=np.int32)

    def sampler(self, logprobs: mx.array) -> mx.array:
        token = mx.argmax(logprobs, axis=-1) if self.inner is None else self.inner(logprobs)
        self.pending = token
        return token

    def processor(self, tokens: mx.array, logits: mx.array) -> mx.array:
        m = self.matcher
        # The step's forward is queued first (behind the previous step, still running maybe), so the
        # device never waits for the mask; the token sampled in the previous step was queued before
        # it, so reading it waits for that step only, and the mask is computed while the forward runs.
        mx.async_eval(logits)
        if self.pending is not None:
            token = as_int(self.pending)
            self.pending = None
            if token not in self.stops or not m.is_accepting():
                m.consume_token(token)
        if m.is_error():  # a token the grammar refused (cannot happen through this mask): end the sequence
            return apply_bitmask(logits, np.zeros_like(self.words), self.stops, True)
        m.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        return apply_bitmask(logits, self.words, self.stops, m.is_accepting())
