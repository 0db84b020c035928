"""Per-sequence logits processors for a request's controls, from mlx-lm's own parts.

``BatchGenerator`` runs a list of processors per sequence (``insert_segments``'s
``logits_processors``) on that row's logits before its sampler, greedy included; a sequence with
none costs the batch nothing (mlx-lm skips the per-row pass when no row has any). The bias is
``mlx_lm.sample_utils.make_logits_processors``'s; the penalties are mlx-lm's
``make_repetition_penalty``, ``make_presence_penalty`` and ``make_frequency_penalty``, given the
history OpenAI and vLLM penalize, with no window: presence and frequency count every token the
sequence has emitted (the prompt does not count), repetition every token of the prompt and of the
output. mlx-lm's own default (the last 20 tokens, prompt included) would forget a token 20 steps
later. ``min_tokens`` is the one processor added here.

A processor sees the tokens in the sequence's cache plus the one being fed (the prompt, then what
it emitted), so ``tokens[prompt_len:]`` is what the sequence has emitted before the one now
sampled, whichever way the sequence entered the batch (fresh, from the prefix cache, whose hit is
the prompt's start and is in ``tokens`` like the rest of the prompt, or put back after a pause or a
burst with its whole history).

A burst's verify runs the same processors on each of its rows, over the history extended by the
drafts before that row (``workers.engine.spec.controls``), so a sequence with any still bursts and
emits classic decode's tokens. They are pure functions of (tokens, logits), which is what makes
that exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import mlx.core as mx
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_logits_processors,
    make_presence_penalty,
    make_repetition_penalty,
)

from workers.api import SamplingParams

#: ``(tokens, logits) -> logits``, as ``BatchGenerator`` calls each one (logits ``[1, V]``).
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

#: A context size past any token history (mlx-lm keeps ``tokens[-context_size:]``; MLX slice
#: bounds are 32-bit): the penalties see the whole history they are given.
WHOLE_HISTORY = 2**31 - 1


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


def output_only(penalty: LogitsProcessor, prompt_len: int) -> LogitsProcessor:
    """``penalty`` over the tokens emitted so far: the history past the prompt's ``prompt_len``."""

    def over_output(tokens: mx.array, logits: mx.array) -> mx.array:
        return penalty(tokens[prompt_len:], logits)

    return over_output


def processors_for(params: SamplingParams, prompt_len: int, stops: Iterable[int]) -> list[LogitsProcessor]:
    """The processors one sequence runs, in mlx-lm's order (bias, repetition over the prompt and the
    output, presence and frequency over the output), then ``min_tokens``. Empty for a request with
    no controls: plain requests get none."""
    processors: list[LogitsProcessor] = make_logits_processors(logit_bias=dict(params.logit_bias) or None)
    if params.repetition_penalty is not None:
        processors.append(make_repetition_penalty(params.repetition_penalty, WHOLE_HISTORY))
    if params.presence_penalty:
        processors.append(output_only(make_presence_penalty(params.presence_penalty, WHOLE_HISTORY), prompt_len))
    if params.frequency_penalty:
        processors.append(output_only(make_frequency_penalty(params.frequency_penalty, WHOLE_HISTORY), prompt_len))
    stops = frozenset(stops)
    if params.min_tokens > 0 and stops:
        processors.append(min_tokens_processor(prompt_len, params.min_tokens, stops))
    return processors
