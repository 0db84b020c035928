"""The prefix cache: KV of earlier sequences reused for later prompts that start with the same tokens.

A finished (or cancelled) sequence leaves the KV of every token in its cache (prompt and generated
tokens) in mlx-lm's ``LRUPromptCache``; a new prompt takes a copy of the longest cached prefix and
only its suffix is prefilled. Entries are keyed by (salt, tokens): a job only ever sees entries made
under its own salt, so one tenant's timing cannot reveal another's prompt (``salt_for``).

Reuse is only as exact as the backend: a suffix prefilled on a cached prefix runs other row counts and
chunk boundaries than one whole prefill. ``warm_vs_cold`` compares the two byte for byte at load, and
the cache serves only on an exact verdict (or when the operator allows inexact output).
"""

from __future__ import annotations

import copy
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from workers.arrays import as_int
from workers.mlxlm import merge_caches

log = logging.getLogger("mlx_batchd.engine")

#: The salt of tenants marked shareable; per-tenant salts carry a prefix, so no tenant name equals it.
SHARED_SALT = "shared"
#: Greedy decode steps compared after the first token of each warm-vs-cold draw.
DECODE_STEPS = 3
#: A shorter match is a miss: prompts of one template share a few tokens, and a hit costs a copy of
#: the whole entry it comes from.
MIN_HIT_TOKENS = 16


def salt_for(tenant: str, shareable: bool) -> str:
    """The cache salt the front end gives a tenant's jobs: the shared salt, or one only it has."""
    return SHARED_SALT if shareable else f"tenant:{tenant}"


# --------------------------------------------------------------------------- the exactness check


@dataclass
class Draw:
    """One warm-vs-cold comparison: a prompt whose first ``cached`` tokens come from an entry that
    held ``trimmed`` tokens more and whose last ``decoded`` tokens were fed one at a time (an earlier
    turn's generated tokens)."""

    prompt: int
    cached: int
    decoded: int = 0
    trimmed: int = 0
    #: The entry held more tokens than the sliding window (its rotating caches had dropped keys).
    past_window: bool = False
    differing_bytes: int = 0
    total_bytes: int = 0
    skipped: str | None = None


@dataclass
class ReuseVerdict:
    """``exact``: reuse may serve. ``window_only``: only entries whose sliding-window caches hold every
    token they were given (no more than the window); past it warm differed from cold."""

    exact: bool
    reason: str
    draws: list[Draw] = field(default_factory=list)
    seconds: float = 0.0
    window_only: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "draws": [asdict(d) for d in self.draws]}


def make_draws(prefill_step: int, window: int | None, context: int) -> list[Draw]:
    """Cached parts that end mid-chunk and before mlx-lm's 256-token growth step, an earlier turn's
    decoded tokens, a trimmed longer entry, a cold prefill that crosses a chunk boundary the warm
    one does not, and, for sliding-window models, entries within and past the window."""
    draws = [Draw(300, 200), Draw(160, 120, decoded=24), Draw(300, 180, trimmed=40)]
    draws.append(Draw(prefill_step + 50, max(1, prefill_step - 48)))
    if window:
        draws += [Draw(2 * window + 40, window - 8, decoded=8), Draw(2 * window, window // 2, trimmed=window // 4)]
        draws.append(Draw(2 * window + 40, window + 17, decoded=8))
        for d in draws:
            d.past_window = d.cached + d.trimmed > window
    return [d for d in draws if d.prompt + DECODE_STEPS < context]


def _feed(model: Any, cache: list[Any], tokens: list[int], step: int, singles: int) -> mx.array:
    """Feed ``tokens`` as serving does: all but the last ``singles`` in chunks of ``step`` (prefill),
    those one at a time (decode); returns the last forward's logits row."""
    split = len(tokens) - singles
    for i in range(0, split, step):
        model(mx.array([tokens[i : min(i + step, split)]]), cache=cache)
        mx.eval([c.state for c in cache])
    logits = mx.array(0)
    for t in tokens[split:]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        mx.eval(logits)
    return logits


def _continue(
    model: Any, cache: list[Any], first: mx.array, tokens: list[int] | None
) -> tuple[list[mx.array], list[int]]:
    """Greedy decode steps after ``first``: the rows and the tokens fed (``tokens`` when given)."""
    rows, fed = [first], []
    for i in range(DECODE_STEPS):
        t = as_int(mx.argmax(rows[-1])) if tokens is None else tokens[i]
        fed.append(t)
        rows.append(model(mx.array([[t]]), cache=cache)[0, -1])
        mx.eval(rows[-1])
    return rows, fed


def _differing(a: mx.array, b: mx.array) -> tuple[int, int]:
    """(differing bytes, total bytes) of two arrays' raw bytes (NaNs and signed zeros compare exactly)."""
    va, vb = mx.view(a.flatten(), mx.uint8), mx.view(b.flatten(), mx.uint8)
    if va.shape != vb.shape:
        return max(va.size, vb.size), max(va.size, vb.size)
    return as_int(mx.sum(va != vb)), int(va.size)


def run_draw(model: Any, d: Draw, prefill_step: int, vocab: int, rng: random.Random) -> None:
    """Run one draw and fill in its differing and total bytes (or why it was skipped)."""
    prompt = [rng.randrange(vocab) for _ in range(d.prompt)]
    entry = prompt[: d.cached] + [rng.randrange(vocab) for _ in range(d.trimmed)]
    # The entry as a finished sequence leaves it: its prompt's last token and its generated ones fed
    # one at a time, extracted from the batch cache as ``BatchGenerator`` extracts it.
    batch = merge_caches([make_prompt_cache(model)])
    _feed(model, batch, entry, prefill_step, d.decoded + 1)
    stored = [c.extract(0) for c in batch]
    if d.trimmed and not can_trim_prompt_cache(stored):
        d.skipped = "entry not trimmable"
        return
    warm_cache = copy.deepcopy(stored)
    trim_prompt_cache(warm_cache, d.trimmed)
    cold_cache = merge_caches([make_prompt_cache(model)])
    cold, fed = _continue(model, cold_cache, _feed(model, cold_cache, prompt, prefill_step, 1), None)
    warm_batch = merge_caches([warm_cache])
    warm, _ = _continue(model, warm_batch, _feed(model, warm_batch, prompt[d.cached :], prefill_step, 1), fed)
    d.differing_bytes, d.total_bytes = _differing(mx.stack(cold), mx.stack(warm))


def warm_vs_cold(
    model: Any, *, prefill_step: int, vocab_size: int, window: int | None = None, context: int = 1 << 30, seed: int = 0
) -> ReuseVerdict:
    """Prefill each draw's prompt whole (cold) and as cached prefix + suffix (warm), then decode a few
    greedy steps; the verdict is exact when every logits row is byte-identical."""
    tic = time.perf_counter()
    rng = random.Random(seed)
    draws = make_draws(prefill_step, window, context)
    for d in draws:
        run_draw(model, d, prefill_step, vocab_size, rng)
    ran = [d for d in draws if d.skipped is None]
    bad = [d for d in ran if d.differing_bytes]
    within = [d for d in ran if not d.past_window]
    seconds = time.perf_counter() - tic
    if not ran:
        return ReuseVerdict(False, "no draw could run", draws, seconds=seconds)
    if not bad:
        return ReuseVerdict(True, f"warm == cold byte for byte on {len(ran)} draws", draws, seconds=seconds)
    d = bad[0]
    differs = (
        f"{d.differing_bytes}/{d.total_bytes} bytes differ (prompt {d.prompt}, cached {d.cached}, "
        f"decoded {d.decoded}, trimmed {d.trimmed})"
    )
    if window and within and all(b.past_window for b in bad):
        reason = f"warm == cold only for entries within the {window}-token window; past it {differs}"
        return ReuseVerdict(True, reason, draws, window_only=True, seconds=seconds)
    return ReuseVerdict(False, f"warm differs from cold: {differs}", draws, seconds=seconds)


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


def checked(
    model: Any,
    max_bytes: int,
    *,
    prefill_step: int,
    vocab_size: int,
    window: int | None,
    context: int,
    allow_inexact: bool = False,
) -> PrefixCache:
    """A prefix cache gated by ``warm_vs_cold`` on ``model`` (a failing check is a declined verdict)."""
    if max_bytes <= 0:
        return PrefixCache(0)
    try:
        verdict = warm_vs_cold(model, prefill_step=prefill_step, vocab_size=vocab_size, window=window, context=context)
    except Exception as exc:
        log.exception("the prefix cache's warm-vs-cold check failed")
        verdict = ReuseVerdict(False, f"the check failed: {exc!r}")
    log.info("prefix cache: %s (%s)", "serving" if verdict.exact or allow_inexact else "declined", verdict.reason)
    return PrefixCache(max_bytes, verdict, allow_inexact)
