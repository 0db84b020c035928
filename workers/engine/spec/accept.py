"""Deciding which drafted tokens a verify round keeps.

Greedy: keep the longest prefix of drafts equal to the target's argmax, then the target's own
token at the first mismatch (or after the last draft). With an exact verify this is what classic
decode emits, token for token.

Sampled: speculative sampling (Leviathan et al. 2023; Chen et al. 2023). Draft ``d_j`` drawn from
``q_j`` is kept with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token
is drawn from ``norm(max(0, p_j - q_j))``; if every draft is kept a bonus is drawn from
``p_{k+1}``. Every emitted token is then distributed exactly as the target's sampler would
distribute it. A deterministic drafter (prompt lookup) has a one-hot ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from workers.engine.sampling import SeededSampler
from workers.kernels import as_float, as_int


@dataclass(frozen=True)
class Outcome:
    """``accepted`` drafts were kept; ``next_token`` follows them (the target's choice)."""

    accepted: int
    next_token: int


def accept_greedy(drafts: list[int], logits: mx.array) -> Outcome:
    """``logits``: ``[len(drafts) + 1, V]`` verify rows (row j predicts the token after input j)."""
    choice: list[int] = mx.argmax(logits, axis=-1).tolist()  # type: ignore[assignment]
    a = 0
    while a < len(drafts) and drafts[a] == choice[a]:
        a += 1
    return Outcome(a, int(choice[a]))


def accept_sampled(drafts: list[int], q: mx.array | None, logprobs: mx.array, sampler: SeededSampler) -> Outcome:
    """``logprobs``: target rows ``[k + 1, V]``; ``q``: the drafter's ``[k, V]`` distributions, or
    ``None`` when the drafts were chosen deterministically (one-hot)."""
    p = sampler.probs(logprobs)
    for j, d in enumerate(drafts):
        pj = p[j]
        qd = 1.0 if q is None else as_float(q[j, d])
        u = as_float(mx.random.uniform(key=sampler.next_key()))
        if qd > 0 and u < min(1.0, as_float(pj[d]) / qd):
            continue
        if q is None:
            residual = pj * (mx.arange(pj.shape[0]) != d)
        else:
            residual = mx.maximum(pj - q[j], 0.0)
        total = as_float(mx.sum(residual))
        if total <= 0.0:  # p and q agree exactly where p has mass: fall back to p itself
            residual, total = pj, as_float(mx.sum(pj))
        token = mx.random.categorical(mx.log(residual / total), key=sampler.next_key())
        return Outcome(j, as_int(token))
    token = mx.random.categorical(mx.log(p[len(drafts)]), key=sampler.next_key())
    return Outcome(len(drafts), as_int(token))
