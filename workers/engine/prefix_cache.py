"""The prefix cache: KV of earlier sequences reused for later prompts that start with the same tokens.

A finished (or cancelled) sequence leaves the KV of every token in its cache (prompt and generated
tokens) in mlx-lm's ``LRUPromptCache``; a new prompt takes a copy of the longest cached prefix and
only its suffix is prefilled. Entries are keyed by (salt, tokens): a job only ever sees entries made
under its own salt, so one tenant's timing cannot reveal another's prompt (``salt_for``).

Reuse is only as exact as the backend: the cache serves only on an exact verdict of the exactness
check (``prefix_check``), or when the operator allows inexact output. ``checked`` builds the cache
with the check run at once; a daemon whose check is not stored yet serves with the cache off (no
verdict) while the check runs between its steps (``Check.steps``), and sets the verdict at its end.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from workers.engine.prefix_check import (
    CheckStore,
    ReuseVerdict,
    check_fingerprint,
    check_pairing,
    warm_vs_cold,
    warm_vs_cold_steps,
)

log = logging.getLogger("mlx_batchd.engine")

#: A shorter match is a miss: prompts of one template share a few tokens, and a hit costs a copy of
#: the whole entry it comes from.
MIN_HIT_TOKENS = 16


# --------------------------------------------------------------------------- the cache


@dataclass
class Lookup:
    """What a prompt gets from the cache: a private copy of the KV of ``cached`` (``None`` on a miss)
    and the ``rest`` to prefill (never empty: the last prompt token is always fed)."""

    cache: list[Any] | None
    cached: list[int]
    rest: list[int]


@dataclass
class Counters:
    queries: int = 0
    #: Lookups that found a prefix, and the prompt tokens those served (and all prompt tokens looked up).
    hits: int = 0
    hit_tokens: int = 0
    lookup_tokens: int = 0
    stored: int = 0
    #: Entries dropped to stay under the byte bound (not counting prefixes a longer entry superseded).
    evictions: int = 0
    #: Entries not stored because one alone exceeds the bound, or because the verdict covers only
    #: entries within the sliding window and this one is past it.
    too_large: int = 0
    past_window: int = 0


def _past_window(cache: list[Any]) -> bool:
    """Whether a sliding-window layer's cache has dropped keys (it was given more than its size)."""
    return any(isinstance(c, RotatingKVCache) and c.offset > c.max_size for c in cache)


def _compact(cache: list[Any]) -> list[Any]:
    """The cache with each ``KVCache`` cut to its tokens (a burst's grows in 4,096-token steps), its
    evaluation queued, so an entry holds what ``nbytes`` says and soon no graph reaching into a batch's
    buffers. Queued, not waited for: a finishing step that blocked here would stall the GPU's pipeline
    of the next batched steps once per finished sequence."""
    out: list[Any] = []
    for c in cache:
        keys: Any = getattr(c, "keys", None)
        values: Any = getattr(c, "values", None)
        if type(c) is KVCache and keys is not None and keys.shape[2] != c.offset:
            k = KVCache()
            k.keys = mx.contiguous(keys[..., : c.offset, :])
            k.values = mx.contiguous(values[..., : c.offset, :])
            k.offset = c.offset
            c = k
        out.append(c)
    mx.async_eval([c.state for c in out])
    return out


class PrefixCache:
    """mlx-lm's ``LRUPromptCache`` with salts as its model keys, a byte bound, counters and a verdict.

    Recency is by insertion: a request that hit an entry stores its own longer one when it ends.
    Entries share no memory: each holds the KV of all its tokens.
    """

    def __init__(self, max_bytes: int, verdict: ReuseVerdict | None = None, allow_inexact: bool = False) -> None:
        self.max_bytes = max_bytes
        self.verdict = verdict
        self.allow_inexact = allow_inexact
        self.counters = Counters()
        # The byte bound is applied here, after each insert, so evictions can be counted.
        self._lru = LRUPromptCache(max_size=1 << 62)

    @property
    def serving(self) -> bool:
        """Whether lookups and stores run: a bound, and an exact verdict or the operator's leave."""
        return self.max_bytes > 0 and self.verdict is not None and (self.verdict.exact or self.allow_inexact)

    def lookup(self, salt: str | None, prompt: list[int]) -> Lookup:
        if salt is None or not self.serving or len(prompt) < 2:
            return Lookup(None, [], prompt)
        self.counters.queries += 1
        self.counters.lookup_tokens += len(prompt)
        cache, rest = self._lru.fetch_nearest_cache(salt, prompt)
        if cache is not None and not rest:  # the whole prompt is cached: feed its last token again
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
            else:
                cache, rest = None, prompt
        cached = prompt[: len(prompt) - len(rest)]
        if cache is None or len(cached) < MIN_HIT_TOKENS:
            return Lookup(None, [], prompt)
        self.counters.hits += 1
        self.counters.hit_tokens += len(cached)
        return Lookup(cache, cached, list(rest))

    def store(self, salt: str | None, tokens: list[int], cache: list[Any]) -> None:
        """Keep ``cache`` (the KV of exactly ``tokens``; the caller gives it up) under ``salt``."""
        if salt is None or not self.serving or len(tokens) < 2:
            return
        if self.verdict is not None and self.verdict.window_only and _past_window(cache):
            self.counters.past_window += 1
            return
        cache = _compact(cache)
        nbytes = sum(c.nbytes for c in cache)
        if nbytes > self.max_bytes:
            self.counters.too_large += 1
            return
        self._lru.insert_cache(salt, list(tokens), cache)
        self.counters.stored += 1
        before = len(self._lru)
        self._lru.trim_to(n_bytes=self.max_bytes)
        self.counters.evictions += before - len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def snapshot(self) -> dict[str, Any]:
        c = self.counters
        return {
            "enabled": self.max_bytes > 0,
            "serving": self.serving,
            "max_bytes": self.max_bytes,
            "bytes": self.nbytes,
            "entries": len(self._lru),
            **asdict(c),
            "hit_rate": c.hit_tokens / c.lookup_tokens if c.lookup_tokens else 0.0,
            "allow_inexact": self.allow_inexact,
            "verdict": None if self.verdict is None else self.verdict.as_dict(),
        }


@dataclass(frozen=True)
class Check:
    """The cache's exactness check on ``model``: read from ``store`` where it holds a result for the
    ``serving`` pairing (and what picks the draws), else measured (``warm_vs_cold``) and stored there
    (a failed check is not: it is a declined verdict). ``run`` checks at once; ``steps`` a draw at a
    time, for an engine that serves with the cache off meanwhile (``workers.engine.background``)."""

    model: Any
    prefill_step: int
    vocab_size: int
    window: int | None
    context: int
    store: CheckStore | None = None
    serving: dict[str, Any] | None = None

    def _key(self) -> tuple[str, dict[str, Any]]:
        """The store's fingerprint and pairing (``""`` without a store or a serving pairing)."""
        if self.store is None or self.serving is None:
            return "", {}
        pairing = check_pairing(
            self.serving,
            prefill_step=self.prefill_step,
            vocab_size=self.vocab_size,
            window=self.window,
            context=self.context,
        )
        return check_fingerprint(pairing), pairing

    def stored(self) -> ReuseVerdict | None:
        """The stored result for this pairing, if any."""
        fingerprint, _ = self._key()
        return None if not fingerprint or self.store is None else self.store.get(fingerprint)

    def run(self) -> ReuseVerdict:
        found = self.stored()
        if found is not None:
            return found
        log.info("prefix cache: checking that reuse is exact on this model (once; the result is kept)")
        try:
            return self._kept(
                warm_vs_cold(
                    self.model,
                    prefill_step=self.prefill_step,
                    vocab_size=self.vocab_size,
                    window=self.window,
                    context=self.context,
                )
            )
        except Exception as exc:
            return self._failed(exc)

    def steps(self) -> Generator[str, None, ReuseVerdict]:
        found = self.stored()
        if found is not None:
            return found
        log.info("prefix cache: checking that reuse is exact on this model, between steps (the result is kept)")
        try:
            check = warm_vs_cold_steps(self.model, self.prefill_step, self.vocab_size, self.window, self.context)
            return self._kept((yield from check))
        except Exception as exc:
            return self._failed(exc)

    def _kept(self, verdict: ReuseVerdict) -> ReuseVerdict:
        fingerprint, pairing = self._key()
        if fingerprint and self.store is not None:
            self.store.put(fingerprint, pairing, verdict)
        return verdict

    def _failed(self, exc: Exception) -> ReuseVerdict:
        log.exception("the prefix cache's warm-vs-cold check failed")
        return ReuseVerdict(False, f"the check failed: {exc!r}")


def log_verdict(verdict: ReuseVerdict, allow_inexact: bool) -> None:
    """One line: whether the cache serves, and why."""
    how = "serving" if verdict.exact or allow_inexact else "declined"
    log.info("prefix cache: %s (%s%s)", how, "stored check: " if verdict.from_cache else "", verdict.reason)


def checked(
    model: Any,
    max_bytes: int,
    *,
    prefill_step: int,
    vocab_size: int,
    window: int | None,
    context: int,
    allow_inexact: bool = False,
    store: CheckStore | None = None,
    serving: dict[str, Any] | None = None,
) -> PrefixCache:
    """A prefix cache gated by the check on ``model``, run now (``Check.run``; a failing check is a
    declined verdict). With a ``store`` and the ``serving`` pairing, a result stored for exactly that
    pairing is used instead of checking again, and a new one is stored (a failed check is not)."""
    if max_bytes <= 0:
        return PrefixCache(0)
    verdict = Check(model, prefill_step, vocab_size, window, context, store, serving).run()
    log_verdict(verdict, allow_inexact)
    return PrefixCache(max_bytes, verdict, allow_inexact)
