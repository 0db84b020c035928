"""Per-sequence logits processors for a request's controls, from mlx-lm's own parts.

``BatchGenerator`` runs a list of processors per sequence (``insert_segments``'s
``logits_processors``) on that row's logits before its sampler, greedy included; a sequence with
none costs the batch nothing (mlx-lm skips the per-row pass when no row has any). The penalties
and the bias are ``mlx_lm.sample_utils.make_logits_processors`` as is, over mlx-lm's default
context (the last 20 tokens, the prompt included); ``min_tokens`` is the one processor added here.

A processor sees the tokens in the sequence's cache plus the one being fed (the prompt, then what
it emitted), so ``len(tokens) - prompt_len`` is how many tokens the sequence has emitted before the
one now sampled, whichever way the sequence entered the batch (fresh, from the prefix cache, or put
back after a pause or a burst).

A burst's verify runs the same processors on each of its rows, over the history extended by the
drafts before that row (``workers.engine.spec.controls``), so a sequence with any still bursts and
emits classic decode's tokens. They are pure functions of (tokens, logits), which is what makes
that exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from workers.api import SamplingParams

#: ``(tokens, logits) -> logits``, as ``BatchGenerator`` calls each one (logits ``[1, V]``).
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def stop_ids(params: SamplingParams, eos_token_ids: Iterable[int], stop_token_ids: Iterable[int]) -> frozenset[int]:
    """The tokens that end a sequence: end-of-sequence (unless ``ignore_eos``) and its own stop ids."""
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return frozenset((*eos, *stop_token_ids))


def min_tokens_processor(prompt_len: int, min_tokens: int, stops: Iterable[int]) -> LogitsProcessor:
    """Make every token of ``stops`` impossible until ``min_tokens`` tokens are out."""
    ids = mx.array(sorted(stops), dtype=mx.int32)

    def suppress_stops(tokens: mx.array, logits: mx.array) -> mx.array:
        if len(tokens) - prompt_len < min_tokens:
            return logits.at[:, ids].add(-math.inf)
        return logits

    return suppress_stops


def processors_for(params: SamplingParams, prompt_len: int, stops: Iterable[int]) -> list[LogitsProcessor]:
    """The processors one sequence runs, in mlx-lm's order (bias, repetition, presence, frequency),
    then ``min_tokens``. Empty for a request with no controls: plain requests get none."""
    processors: list[LogitsProcessor] = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )
    stops = frozenset(stops)
    if params.min_tokens > 0 and stops:
        processors.append(min_tokens_processor(prompt_len, params.min_tokens, stops))
    return processors
