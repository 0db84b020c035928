"""The sampler is well-defined over every value the protocol accepts.

Checked against a float64 numpy reference of which tokens a draw may return: every filter is
decided on the unfiltered distribution, a token must pass them all, the most likely token always
passes, and temperatures below ``GREEDY_BELOW`` are the argmax. The reference is loosened by a
hair at the filters' boundaries (float32 vs float64 rounding) and never anywhere else."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from workers.api import SamplingParams
from workers.engine.sampling import GREEDY_BELOW, make_sampler
from workers.kernels.arrays import as_int

#: A draw never lands on a token whose scaled log-weight trails the top one's by more than this
#: (Gumbel noise in float32 spans about 21; the bound leaves room for rounding).
REACH = 50.0


def reference_allowed(x: np.ndarray, o: SamplingParams) -> np.ndarray:
    """Which tokens have probability > 0 for logprobs ``x`` (a float64 copy of the float32 row)."""
    v = x.shape[0]
    top = x.max()
    keep = np.ones(v, dtype=bool)
    if o.top_p < 1.0:
        p = np.exp(x - top)
        above = np.array([p[x > xi].sum() for xi in x])  # mass strictly more likely than each token
        keep &= above < o.top_p * p.sum() * (1 + 1e-4) + 1e-6 * p.sum()
    if o.min_p > 0.0:
        log_min_p = math.log(o.min_p)
        keep &= x >= top + log_min_p - 1e-5 * (1 + abs(top) + abs(log_min_p))
    if 0 < o.top_k < v:
        keep &= np.array([(x > xi).sum() for xi in x]) < o.top_k
    keep[x == top] = True  # the most likely token always passes
    return keep


def reference_reachable(x: np.ndarray, o: SamplingParams) -> np.ndarray:
    """The allowed tokens a draw can actually return: those not far below the top at this temperature."""
    with np.errstate(over="ignore"):
        return reference_allowed(x, o) & ((x.max() - x) / o.temperature <= REACH)


def logprobs_of(logits: list[float]) -> mx.array:
    row = mx.array([logits], dtype=mx.float32)
    return row - mx.logsumexp(row, axis=-1, keepdims=True)


def log_uniform(lo_exp: float, hi_exp: float) -> st.SearchStrategy[float]:
    return st.floats(lo_exp, hi_exp).map(lambda e: 10.0**e)


LOGIT = st.one_of(
    st.floats(-50, 50, width=32),
    st.sampled_from([0.0, 1.0, -3.0, 2.5]),  # ties
    st.floats(-1e4, 1e4, width=32),
)
TEMPERATURE = st.one_of(
    st.just(0.0),
    st.sampled_from([5e-324, 1e-300, 1e-45, 1e-39, 1e-38, 1e-30, 9.99e-7, GREEDY_BELOW, 1.01e-6, 1e-3, 1.0, 100.0]),
    log_uniform(-330, 2).map(lambda t: min(t, 100.0)),
    st.floats(0.0, 100.0),
)
TOP_P = st.one_of(
    st.just(1.0),
    st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 0.5, 0.999999]),
    log_uniform(-330, 0).filter(lambda p: 0 < p <= 1),
    st.floats(0.0, 1.0, exclude_min=True),
)
MIN_P = st.one_of(
    st.just(0.0), st.sampled_from([5e-324, 1e-300, 1e-8, 0.5, 1.0]), st.floats(0.0, 1.0), log_uniform(-330, 0)
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[float], SamplingParams]:
    logits = draw(st.lists(LOGIT, min_size=2, max_size=40))
    top_k = draw(st.one_of(st.just(0), st.integers(1, len(logits) + 3), st.just(10**9)))
    options = SamplingParams(
        temperature=draw(TEMPERATURE),
        top_p=draw(TOP_P),
        top_k=top_k,
        min_p=draw(MIN_P),
        seed=draw(st.integers(0, 2**63 - 1)),
    )
    return logits, options


FLAT = [0.0] * 7 + [0.01]  # every logprob near -2: tiny temperatures overflowed here
SHARP = [-20.0, 3.0, -5.0, 0.5, 2.9, -1.0]


@settings(max_examples=400, deadline=None)
@given(cases())
@example((FLAT, SamplingParams(temperature=1e-38, seed=1)))
@example((FLAT, SamplingParams(temperature=1e-39, seed=2)))
@example((FLAT, SamplingParams(temperature=5e-324, seed=3)))
@example((SHARP, SamplingParams(temperature=1.0, top_p=1e-300, seed=4)))
@example((SHARP, SamplingParams(temperature=1.0, top_p=5e-324, seed=5)))
@example((SHARP, SamplingParams(temperature=1e-3, top_p=1e-300, min_p=1.0, top_k=1, seed=6)))
@example((FLAT, SamplingParams(temperature=100.0, min_p=5e-324, top_k=10**9, seed=7)))
def test_every_draw_is_a_token_the_reference_allows(case: tuple[list[float], SamplingParams]) -> None:
    logits, options = case
    x = logprobs_of(logits)
    ref = np.array(x[0].tolist(), dtype=np.float64)
    sampler = make_sampler(options, len(logits))
    if options.temperature < GREEDY_BELOW:
        assert sampler is None  # greedy: the batch's argmax, exactly
        assert mx.argmax(x, axis=-1).item() == int(np.argmax(ref))
        return
    assert sampler is not None
    allowed = reference_allowed(ref, options)
    probs = np.array(sampler.probs(x)[0].tolist(), dtype=np.float64)
    assert np.all(np.isfinite(probs)) and abs(probs.sum() - 1.0) < 1e-4
    assert not np.any(probs[~allowed] > 0), (probs, allowed)
    reachable = reference_reachable(ref, options)
    for _ in range(4):
        token = as_int(sampler(x))
        assert reachable[token], (token, reachable, ref)
    if reachable.sum() == 1:  # the filters or the temperature leave one token: the argmax
        assert token == int(np.argmax(ref))
