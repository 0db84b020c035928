"""Per-request samplers with their own random stream.

mlx-lm's ``make_sampler`` draws from MLX's global random state, so a request's draws depend on
what else ran before it. A daemon needs ``seed`` to mean the same tokens whatever the batch
holds, so each sampled request gets a private PRNG key that is split once per draw. The filters
(top-p, min-p, top-k) are mlx-lm's own.

Speculative bursts need more than a sample: the target distribution ``p`` the sampler draws from
(to accept or reject drafts) and uniform draws from the same stream; ``SeededSampler`` gives both.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from clients.protocol import SamplingOptions

Sampler = Callable[[mx.array], mx.array]


class SeededSampler:
    """Temperature sampling with mlx-lm's filters and a private key, split per use."""

    def __init__(self, options: SamplingOptions, vocab_size: int) -> None:
        seed = options.seed if options.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        self.inv_temp = 1.0 / options.temperature
        self._filters: list[Callable[[mx.array], mx.array]] = []
        if options.top_p < 1.0:
            self._filters.append(lambda x: apply_top_p(x, options.top_p))
        if options.min_p > 0.0:
            self._filters.append(lambda x: apply_min_p(x, options.min_p))
        if 0 < options.top_k < vocab_size:
            self._filters.append(lambda x: apply_top_k(x, options.top_k))

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def scaled(self, logprobs: mx.array) -> mx.array:
        """Filtered, temperature-scaled log-weights: ``softmax`` of this is the sampled distribution."""
        for f in self._filters:
            logprobs = f(logprobs)
        return logprobs * self.inv_temp

    def probs(self, logprobs: mx.array) -> mx.array:
        """The distribution a draw from ``logprobs`` follows (rows are positions)."""
        return mx.softmax(self.scaled(logprobs), axis=-1)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.random.categorical(self.scaled(logprobs), key=self.next_key())


def make_sampler(options: SamplingOptions, vocab_size: int) -> SeededSampler | None:
    """A sampler for one sequence, or ``None`` for greedy.

    ``None`` lets ``BatchGenerator`` fall back to its shared argmax, so an all-greedy batch
    samples in one call instead of one per row.
    """
    if options.temperature == 0.0:
        return None
    return SeededSampler(options, vocab_size)
