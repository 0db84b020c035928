"""Per-request samplers with their own random stream.

mlx-lm's ``make_sampler`` draws from MLX's global random state, so a request's draws depend on
what else ran before it. A daemon needs ``seed`` to mean the same tokens whatever the batch
holds, so each sampled request gets a private PRNG key that is split once per draw.

Speculative bursts need more than a sample: the target distribution ``p`` the sampler draws from
(to accept or reject drafts) and uniform draws from the same stream; ``SeededSampler`` gives both.

The sampler is defined over every value the wire accepts (``SamplingParams`` states the bounds:
temperature in [0, 100], top_p in (0, 1], min_p in [0, 1], top_k >= 0), in float32 whatever the
model's dtype:

- each filter is decided on the unfiltered distribution and a token must pass all of them:
  top-p keeps a token when the probability mass strictly above it is below ``top_p``, min-p when
  its probability is at least ``min_p`` times the top one's, top-k when fewer than ``top_k``
  tokens are strictly more likely (ties at a boundary are kept). The most likely token passes
  every filter, so at least one token always remains, however small ``top_p`` is;
- a temperature below ``GREEDY_BELOW`` is greedy (argmax), as is 0; above it the kept log-weights
  are shifted so the top one is 0 before dividing by the temperature, so nothing overflows.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx

from workers.api import Job, SamplingParams

Sampler = Callable[[mx.array], mx.array]

#: Temperatures below this sample like temperature 0: the argmax. At 1e-6 a logprob gap of 1e-4
#: already weighs e^-100 against the top token, so the distribution is the argmax in all but ties.
GREEDY_BELOW = 1e-6


def top_p_keep(logprobs: mx.array, top_p: float) -> mx.array:
    """Tokens whose strictly-more-likely mass is below ``top_p`` (always the most likely one)."""
    ascending = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ascending - ascending[..., -1:])  # relative to the top token: no underflow of all
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    dropped = mx.minimum(dropped, logprobs.shape[-1] - 1)  # the top token stays, even if top_p * total is 0
    return logprobs >= mx.take_along_axis(ascending, dropped, axis=-1)


def min_p_keep(logprobs: mx.array, min_p: float) -> mx.array:
    """Tokens at least ``min_p`` times as likely as the most likely one."""
    top = mx.max(logprobs, axis=-1, keepdims=True)
    return logprobs >= top + math.log(min_p)


def top_k_keep(logprobs: mx.array, top_k: int) -> mx.array:
    """The ``top_k`` most likely tokens, with any ties of the last one."""
    kth = mx.min(mx.topk(logprobs, top_k, axis=-1), axis=-1, keepdims=True)
    return logprobs >= kth


class SeededSampler:
    """Temperature sampling with top-p, min-p and top-k filters and a private key, split per use."""

    def __init__(self, options: SamplingParams, vocab_size: int) -> None:
        if not options.temperature >= GREEDY_BELOW:
            raise ValueError(f"temperature {options.temperature} is greedy: use make_sampler")
        seed = options.seed if options.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        self.inv_temp = 1.0 / options.temperature
        self._filters: list[Callable[[mx.array], mx.array]] = []
        if options.top_p < 1.0:
            self._filters.append(lambda x: top_p_keep(x, options.top_p))
        if options.min_p > 0.0:
            self._filters.append(lambda x: min_p_keep(x, options.min_p))
        if 0 < options.top_k < vocab_size:
            self._filters.append(lambda x: top_k_keep(x, options.top_k))

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def scaled(self, logprobs: mx.array) -> mx.array:
        """Filtered, temperature-scaled log-weights: ``softmax`` of this is the sampled distribution.
        The top kept token's weight is exactly 0, the filtered-out ones are ``-inf``."""
        x = logprobs.astype(mx.float32)
        if self._filters:
            keep = self._filters[0](x)
            for f in self._filters[1:]:
                keep = mx.logical_and(keep, f(x))
            x = mx.where(keep, x, -math.inf)
        return (x - mx.max(x, axis=-1, keepdims=True)) * self.inv_temp

    def probs(self, logprobs: mx.array) -> mx.array:
        """The distribution a draw from ``logprobs`` follows (rows are positions)."""
        return mx.softmax(self.scaled(logprobs), axis=-1)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.random.categorical(self.scaled(logprobs), key=self.next_key())


def is_greedy(options: SamplingParams) -> bool:
    """Whether ``options`` decode by argmax: temperature 0, or below ``GREEDY_BELOW``."""
    return options.temperature < GREEDY_BELOW


def make_sampler(options: SamplingParams, vocab_size: int) -> SeededSampler | None:
    """A sampler for one sequence, or ``None`` for greedy.

    ``None`` lets ``BatchGenerator`` fall back to its shared argmax, so an all-greedy batch
    samples in one call instead of one per row.
    """
    if is_greedy(options):
        return None
    return SeededSampler(options, vocab_size)


def with_seed(job: Job) -> Job:
    """``job`` with a seed drawn now when it samples without one: the draw is made once, by the
    process that decides (rank 0), so every rank samples the same tokens."""
    if is_greedy(job.sampling) or job.sampling.seed is not None:
        return job
    return replace(job, sampling=replace(job.sampling, seed=secrets.randbits(63)))
