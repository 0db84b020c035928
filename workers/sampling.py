"""Per-request samplers with their own random stream.

mlx-lm's ``make_sampler`` draws from MLX's global random state, so a request's draws depend on
what else ran before it. A daemon needs ``seed`` to mean the same tokens whatever the batch
holds, so each sampled request gets a private PRNG key that is split once per step. The filters
(top-p, min-p, top-k) are mlx-lm's own.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from clients.protocol import SamplingOptions

Sampler = Callable[[mx.array], mx.array]


def make_sampler(options: SamplingOptions, vocab_size: int) -> Sampler | None:
    """A sampler for one sequence, or ``None`` for greedy.

    ``None`` lets ``BatchGenerator`` fall back to its shared argmax, so an all-greedy batch
    samples in one call instead of one per row.
    """
    if options.temperature == 0.0:
        return None
    seed = options.seed if options.seed is not None else secrets.randbits(63)
    key = mx.random.key(seed)
    filters: list[Callable[[mx.array], mx.array]] = []
    if options.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, options.top_p))
    if options.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, options.min_p))
    if 0 < options.top_k < vocab_size:
        filters.append(lambda x: apply_top_k(x, options.top_k))
    inv_temp = 1.0 / options.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample
