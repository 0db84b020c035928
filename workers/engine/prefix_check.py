"""The prefix cache's exactness check: is a suffix prefilled on a cached prefix the same bytes as one
whole prefill on this model (``warm_vs_cold``, run once per pairing, a forward at a time between
the engine's steps: ``warm_vs_cold_steps``), and its result stored per pairing (``CheckStore``) so a
restart does not measure it again.

Reuse is only as exact as the backend: a suffix prefilled on a cached prefix runs other row counts
and chunk boundaries than one whole prefill. The cache (``prefix_cache``) serves only on an exact
verdict, or when the operator allows inexact output.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from workers.exact import drive, prefill_chunk
from workers.kernels import as_int, merge_caches

log = logging.getLogger("mlx_batchd.engine")

#: Greedy decode steps compared after the first token of each warm-vs-cold draw.
DECODE_STEPS = 3


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
    #: Read back from the check store (``CheckStore``) instead of measured by this process.
    from_cache: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "draws": [asdict(d) for d in self.draws]}

    @classmethod
    def from_json(cls, data: Any) -> ReuseVerdict:
        """A verdict from ``as_dict``'s output; ``ValueError`` unless every field has its exact shape."""
        _check_fields(data, _VERDICT_FIELDS, "verdict")
        draws = []
        for i, d in enumerate(data["draws"]):
            _check_fields(d, _DRAW_FIELDS, f"verdict.draws[{i}]")
            draws.append(Draw(**d))
        return cls(**{**data, "draws": draws})


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


def _feed(
    model: Any, cache: list[Any], tokens: list[int], step: int, singles: int, what: str, last: bool = False
) -> Generator[str, None, mx.array]:
    """Feed ``tokens`` as serving does: all but the last ``singles`` in chunks of ``step`` (prefill;
    less where the engine's pace asks it, ``workers.exact.paced``), those one at a time (decode);
    returns the last forward's logits row. A unit a forward: each forward's results are evaluated
    before the yield that ends its unit (``last``: none after the last forward, the caller's unit
    goes on)."""
    step = min(step, prefill_chunk())
    split = len(tokens) - singles
    starts = range(0, split, step)
    count = len(starts) + len(tokens[split:])
    done = 0
    for i in starts:
        model(mx.array([tokens[i : min(i + step, split)]]), cache=cache)
        mx.eval([c.state for c in cache])
        done += 1
        if done < count or not last:
            yield f"{what} forward {done}/{count}"
    logits = mx.array(0)
    for t in tokens[split:]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        mx.eval(logits, [c.state for c in cache])
        done += 1
        if done < count or not last:
            yield f"{what} forward {done}/{count}"
    return logits


def _continue(
    model: Any, cache: list[Any], first: mx.array, tokens: list[int] | None, what: str, last: bool = False
) -> Generator[str, None, tuple[list[mx.array], list[int]]]:
    """Greedy decode steps after ``first``: the rows and the tokens fed (``tokens`` when given), a
    unit a forward as ``_feed``'s."""
    rows, fed = [first], []
    for i in range(DECODE_STEPS):
        t = as_int(mx.argmax(rows[-1])) if tokens is None else tokens[i]
        fed.append(t)
        rows.append(model(mx.array([[t]]), cache=cache)[0, -1])
        mx.eval(rows[-1], [c.state for c in cache])
        if i + 1 < DECODE_STEPS or not last:
            yield f"{what} decode {i + 1}/{DECODE_STEPS}"
    return rows, fed


def _differing(a: mx.array, b: mx.array) -> tuple[int, int]:
    """(differing bytes, total bytes) of two arrays' raw bytes (NaNs and signed zeros compare exactly)."""
    va, vb = mx.view(a.flatten(), mx.uint8), mx.view(b.flatten(), mx.uint8)
    if va.shape != vb.shape:
        return max(va.size, vb.size), max(va.size, vb.size)
    return as_int(mx.sum(va != vb)), int(va.size)


def run_draw(model: Any, d: Draw, prefill_step: int, vocab: int, rng: random.Random) -> None:
    """Run one draw and fill in its differing and total bytes (or why it was skipped)."""
    drive(run_draw_steps(model, d, prefill_step, vocab, rng))


def run_draw_steps(
    model: Any, d: Draw, prefill_step: int, vocab: int, rng: random.Random, what: str = "draw"
) -> Generator[str, None, None]:
    """``run_draw`` as units of one forward each (a prefill chunk or one token), each evaluated
    before it yields; the last forward's unit also fills in the draw's outcome (no yield after it).
    The forwards, their chunks and their order are ``run_draw``'s, so the outcome is the same bytes."""
    prompt = [rng.randrange(vocab) for _ in range(d.prompt)]
    entry = prompt[: d.cached] + [rng.randrange(vocab) for _ in range(d.trimmed)]
    # The entry as a finished sequence leaves it: its prompt's last token and its generated ones fed
    # one at a time, extracted from the batch cache as ``BatchGenerator`` extracts it.
    batch = merge_caches([make_prompt_cache(model)])
    yield from _feed(model, batch, entry, prefill_step, d.decoded + 1, f"{what} entry", last=True)
    stored = [c.extract(0) for c in batch]
    if d.trimmed and not can_trim_prompt_cache(stored):
        d.skipped = "entry not trimmable"
        return
    warm_cache = copy.deepcopy(stored)
    trim_prompt_cache(warm_cache, d.trimmed)
    mx.eval([c.state for c in warm_cache])
    yield f"{what} entry stored"
    cold_cache = merge_caches([make_prompt_cache(model)])
    first = yield from _feed(model, cold_cache, prompt, prefill_step, 1, f"{what} cold")
    cold, fed = yield from _continue(model, cold_cache, first, None, f"{what} cold")
    warm_batch = merge_caches([warm_cache])
    first = yield from _feed(model, warm_batch, prompt[d.cached :], prefill_step, 1, f"{what} warm")
    warm, _ = yield from _continue(model, warm_batch, first, fed, f"{what} warm", last=True)
    d.differing_bytes, d.total_bytes = _differing(mx.stack(cold), mx.stack(warm))


def warm_vs_cold(
    model: Any, *, prefill_step: int, vocab_size: int, window: int | None = None, context: int = 1 << 30, seed: int = 0
) -> ReuseVerdict:
    """Prefill each draw's prompt whole (cold) and as cached prefix + suffix (warm), then decode a few
    greedy steps; the verdict is exact when every logits row is byte-identical."""
    return drive(warm_vs_cold_steps(model, prefill_step, vocab_size, window, context, seed))


def warm_vs_cold_steps(
    model: Any, prefill_step: int, vocab_size: int, window: int | None = None, context: int = 1 << 30, seed: int = 0
) -> Generator[str, None, ReuseVerdict]:
    """``warm_vs_cold`` as units of one forward each (``run_draw_steps``; a draw's last unit yields
    its outcome), ending in the verdict: for an engine that serves between them, so a request waits
    for one forward of the check at most."""
    tic = time.perf_counter()
    rng = random.Random(seed)
    draws = make_draws(prefill_step, window, context)
    for i, d in enumerate(draws, 1):
        log.info("prefix cache check: draw %d/%d (prompt %d tokens, %d cached) ...", i, len(draws), d.prompt, d.cached)
        yield from run_draw_steps(model, d, prefill_step, vocab_size, rng, f"draw {i}/{len(draws)}")
        outcome = d.skipped or ("exact" if not d.differing_bytes else f"{d.differing_bytes} bytes differ")
        log.info("prefix cache check: draw %d/%d %s (%.1f s so far)", i, len(draws), outcome, time.perf_counter() - tic)
        yield f"draw {i}/{len(draws)} {outcome}"
    return decide(draws, window, time.perf_counter() - tic)


def decide(draws: list[Draw], window: int | None, seconds: float) -> ReuseVerdict:
    """The verdict the draws' outcomes give (also how a stored verdict is checked against its draws)."""
    ran = [d for d in draws if d.skipped is None]
    bad = [d for d in ran if d.differing_bytes]
    within = [d for d in ran if not d.past_window]
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


# --------------------------------------------------------------------------- the stored check

#: Bump when the check's method changes, so stored results are measured again.
CHECK_VERSION = 1
#: A stored check result larger than this is not read (one holds a few kilobytes).
MAX_CHECK_BYTES = 1 << 20


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


_DRAW_FIELDS: dict[str, Callable[[Any], bool]] = {
    "prompt": _is_count,
    "cached": _is_count,
    "decoded": _is_count,
    "trimmed": _is_count,
    "past_window": _is_bool,
    "differing_bytes": _is_count,
    "total_bytes": _is_count,
    "skipped": lambda v: v is None or _is_str(v),
}
_VERDICT_FIELDS: dict[str, Callable[[Any], bool]] = {
    "exact": _is_bool,
    "reason": _is_str,
    "draws": lambda v: isinstance(v, list),
    "seconds": _is_seconds,
    "window_only": _is_bool,
    "from_cache": _is_bool,
}
_RECORD_FIELDS: dict[str, Callable[[Any], bool]] = {
    "fingerprint": _is_str,
    "pairing": lambda v: isinstance(v, dict),
    "verdict": lambda v: isinstance(v, dict),
}


def _check_fields(data: Any, fields: dict[str, Callable[[Any], bool]], what: str) -> None:
    """``data`` is an object with exactly ``fields``, each passing its check; else ``ValueError``."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} is not an object")
    if set(data) != set(fields):
        raise ValueError(f"{what} has fields {sorted(map(str, data))}, not {sorted(fields)}")
    for name, ok in fields.items():
        if not ok(data[name]):
            raise ValueError(f"{what}.{name} is not valid: {data[name]!r}")


def check_fingerprint(pairing: dict[str, Any]) -> str:
    """sha256 over what can change the check's outcome (``pairing``) and the check's method."""
    text = json.dumps({**pairing, "prefix_check_version": CHECK_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def check_pairing(
    serving: dict[str, Any], *, prefill_step: int, vocab_size: int, window: int | None, context: int
) -> dict[str, Any]:
    """What the check's outcome depends on: the serving pairing (weights, config, caches, backend,
    kernels; ``verdict_store.serving_pairing``) and what picks the draws and their chunks."""
    return {
        **serving,
        "check": "prefix-cache warm-vs-cold",
        "prefill_step": prefill_step,
        "vocab_size": vocab_size,
        "window": window,
        "context": context,
    }


class CheckStore:
    """Prefix-cache check results as JSON files named by fingerprint, beside the probe's verdicts.

    A stored result is used only when every field has its exact shape, its pairing hashes to the
    fingerprint asked for, its draws are the ones the check makes for that pairing and its verdict is
    the one those draws give (``decide``): a damaged or forged file means "check again"."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, fingerprint: str) -> Path:
        return self.root / f"{fingerprint}.json"

    def get(self, fingerprint: str) -> ReuseVerdict | None:
        path = self.path(fingerprint)
        try:
            if not path.is_file():
                return None
            if path.stat().st_size > MAX_CHECK_BYTES:
                raise ValueError(f"it holds more than {MAX_CHECK_BYTES} bytes")
            data = json.loads(path.read_text())
            _check_fields(data, _RECORD_FIELDS, "record")
            pairing = data["pairing"]
            if data["fingerprint"] != fingerprint or check_fingerprint(pairing) != fingerprint:
                raise ValueError("it is the result of another pairing")
            verdict = ReuseVerdict.from_json(data["verdict"])
            _check_consistent(verdict, pairing)
        except Exception as exc:  # anything in the file, however odd, means "check again"
            log.warning("ignoring the stored prefix cache check %s (%s); it runs again", path, exc)
            return None
        verdict.from_cache = True
        return verdict

    def put(self, fingerprint: str, pairing: dict[str, Any], verdict: ReuseVerdict) -> None:
        """Keep ``verdict``; a cache folder that cannot be written costs the store only."""
        record = {"fingerprint": fingerprint, "pairing": pairing, "verdict": {**verdict.as_dict(), "from_cache": False}}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.path(fingerprint).with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=2))
            tmp.replace(self.path(fingerprint))
        except (OSError, TypeError, ValueError) as exc:
            log.warning("cannot keep the prefix cache check in %s (%s); it runs again next start", self.root, exc)


def _check_consistent(verdict: ReuseVerdict, pairing: dict[str, Any]) -> None:
    """``ValueError`` unless the draws are the check's for ``pairing`` and the verdict is theirs."""
    window, context, step = pairing.get("window"), pairing.get("context"), pairing.get("prefill_step")
    if not (window is None or _is_count(window)) or not _is_count(context) or not _is_count(step) or not step:
        raise ValueError("its pairing does not say the check's window, context and prefill step")
    assert isinstance(context, int) and isinstance(step, int)
    expected = [(d.prompt, d.cached, d.decoded, d.trimmed, d.past_window) for d in make_draws(step, window, context)]
    stored = [(d.prompt, d.cached, d.decoded, d.trimmed, d.past_window) for d in verdict.draws]
    if stored != expected:
        raise ValueError("its draws are not the ones the check makes")
    if any(d.differing_bytes > d.total_bytes or (d.skipped is not None and d.total_bytes) for d in verdict.draws):
        raise ValueError("a draw's byte counts do not add up")
    again = decide(verdict.draws, window, verdict.seconds)
    if (again.exact, again.window_only, again.reason) != (verdict.exact, verdict.window_only, verdict.reason):
        raise ValueError("its verdict is not the one its draws give")
