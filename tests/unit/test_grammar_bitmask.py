"""``grammar_mask.apply_bitmask``: llguidance's mask words unpacked on the device give exactly the
per-token mask (unpacked on the host, bit by bit), whatever the vocabulary's size against the words'."""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx
import numpy as np
import pytest

from workers.engine.grammar_mask import apply_bitmask


def _per_token(logits: mx.array, words: np.ndarray, extra: Iterable[int], allow_extra: bool) -> mx.array:
    """The reference: bit ``t % 32`` of word ``t // 32`` allows token ``t``; tokens past the words
    are refused; ``extra`` tokens are set to ``allow_extra``."""
    vocab = logits.shape[-1]
    allowed = np.zeros(vocab, dtype=np.bool_)
    for t in range(min(vocab, words.size * 32)):
        allowed[t] = bool((int(words.view(np.uint32)[t // 32]) >> (t % 32)) & 1)
    for t in extra:
        if 0 <= t < vocab:
            allowed[t] = allow_extra
    return mx.where(mx.array(allowed), logits, mx.array(-np.inf, dtype=logits.dtype))


@pytest.mark.parametrize("vocab,words", [(1000, 32), (1000, 20), (64, 2), (4100, 129)])
@pytest.mark.parametrize("allow", [True, False])
def test_device_unpacked_mask_equals_the_per_token_mask(vocab: int, words: int, allow: bool) -> None:
    rng = np.random.default_rng(vocab + words)
    w = rng.integers(-(2**31), 2**31 - 1, size=words, dtype=np.int64).astype(np.int32)
    logits = mx.array(rng.normal(size=(1, vocab)).astype(np.float32)).astype(mx.bfloat16)
    before = w.copy()
    for extra in ((), (0, 5, 31, 32, vocab - 1), (vocab + 3, -1, 33, words * 32 + 1)):
        got = apply_bitmask(logits, w, extra, allow)
        assert mx.array_equal(got, _per_token(logits, before, extra, allow)).item(), (extra, allow)
        assert np.array_equal(w, before)  # the caller's words (a matcher's buffer) are not changed
