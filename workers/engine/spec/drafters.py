"""Drafters: cheap guesses of the target's next tokens, behind one interface.

A drafter follows one sequence through a burst. ``history`` is every token of the sequence so
far, ending with the *pending* token (chosen by the target, not yet run through it). Each round
the drafter proposes up to ``k`` tokens continuing ``history``; after the target's verify it is
told how many were kept and the new history (kept drafts plus the target's next token), and
rolls its own state back to match.

- ``DraftModel``: a small mlx-lm model with the target's vocabulary and its own KV cache.
- ``PromptLookup``: n-gram matching against the sequence's own tokens; no weights.
- ``MTPDrafter``: the target's multi-token-prediction head (``workers.models.mtp``), fed the target's
  hidden states from each verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from workers.engine.sampling import SeededSampler
from workers.engine.spec.kv_state import restore, save
from workers.kernels import as_int


@dataclass
class Draft:
    tokens: list[int]
    #: ``[len(tokens), V]`` draft distributions when the drafts were sampled; ``None`` when they
    #: were chosen deterministically (greedy, or prompt lookup).
    q: mx.array | None = None


class Drafter(Protocol):
    name: str
    #: Whether ``commit`` needs the target's hidden states from the verify (MTP heads).
    needs_hidden: bool
    #: Whether every proposal is K tokens, so every verify block K + 1 rows (``verify_warmup``
    #: builds that length alone); prompt lookup proposes 0..K.
    fixed_k: bool

    def start(self, history: list[int]) -> None: ...

    def propose(self, k: int, sampler: SeededSampler | None) -> Draft: ...

    def commit(self, accepted: int, history: list[int], hidden: mx.array | None = None) -> None: ...

    def stop(self) -> None: ...


def token_list(row: mx.array) -> list[int]:
    """The token ids of a ``[1, k]`` array (evaluates it)."""
    ids: Any = row[0].tolist()
    return [int(t) for t in ids]


def _choose(logits: mx.array, sampler: SeededSampler | None) -> tuple[int, mx.array | None]:
    """Greedy, or a draw from the request's own filters and temperature (and that distribution)."""
    if sampler is None:
        return as_int(mx.argmax(logits)), None
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    q = sampler.probs(logprobs)
    token = mx.random.categorical(mx.log(q), key=sampler.next_key())
    return as_int(token), q


class DraftModel:
    """A small model with the target's vocabulary, drafting autoregressively from its own cache."""

    needs_hidden = False
    fixed_k = True

    def __init__(self, model: Any, name: str = "draft-model", prefill_step: int = 2048) -> None:
        self.model = model
        self.name = name
        self.prefill_step = prefill_step
        self._cache: list[Any] = []
        self._history: list[int] = []
        self._fed = 0  # history tokens (then drafts) in the cache
        self._drafted = 0

    def start(self, history: list[int]) -> None:
        self._cache = make_prompt_cache(self.model)
        self._history = list(history)
        body = history[:-1]
        for i in range(0, len(body), self.prefill_step):
            self.model(mx.array([body[i : i + self.prefill_step]]), cache=self._cache)
            mx.eval([c.state for c in self._cache])
        self._fed = len(body)

    def propose(self, k: int, sampler: SeededSampler | None) -> Draft:
        inputs = mx.array([self._history[self._fed :]])
        self._drafted = k
        self._fed = len(self._history) + k - 1  # the last draft is proposed, not fed
        if sampler is None:
            # Greedy: each draft feeds the next as an array, so the k steps are one evaluation (one
            # wait for the device instead of k).
            chosen = []
            for _ in range(k):
                inputs = mx.argmax(self.model(inputs, cache=self._cache)[:, -1:], axis=-1).astype(mx.int32)
                chosen.append(inputs)
            return Draft(token_list(mx.concatenate(chosen, axis=1)))
        tokens: list[int] = []
        qs: list[mx.array] = []
        for _ in range(k):
            logits = self.model(inputs, cache=self._cache)[0, -1]
            token, q = _choose(logits, sampler)
            tokens.append(token)
            if q is not None:
                qs.append(q)
            inputs = mx.array([[token]])
        return Draft(tokens, mx.stack(qs) if qs else None)

    def commit(self, accepted: int, history: list[int], hidden: mx.array | None = None) -> None:
        kept = min(accepted, self._drafted - 1)
        trim_prompt_cache(self._cache, (self._drafted - 1) - kept)
        self._fed = len(self._history) + kept
        self._history = list(history)

    def stop(self) -> None:
        self._cache = []


class PromptLookup:
    """Propose the tokens that followed an earlier occurrence of the last n-gram: the most recent
    occurrence that is followed by ``k`` tokens, else the one followed by the most."""

    needs_hidden = False
    fixed_k = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.name = "prompt-lookup"
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._history: list[int] = []

    def start(self, history: list[int]) -> None:
        self._history = list(history)

    def propose(self, k: int, sampler: SeededSampler | None) -> Draft:
        return Draft(self.propose_after(self._history, k))

    def propose_after(self, history: list[int], k: int) -> list[int]:
        """What ``propose`` would give after ``history`` (a function of the history alone, so the
        burst runner can guess the next round's block before this round's result).

        Why not simply the most recent occurrence: in output that repeats with a period shorter
        than ``k`` (a repeated token, a short loop) it is followed by fewer than ``k`` tokens, one
        for a repeated token, so a round would draft one token where the repetition gives ``k``.
        Scanning back from the most recent occurrence, each earlier one is followed by at least as
        many tokens; the first followed by ``k`` ends the scan.
        """
        h = history
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            tail = h[-n:]
            best: list[int] = []
            for start in range(len(h) - n - 1, -1, -1):
                if h[start : start + n] == tail:
                    best = h[start + n : start + n + k]
                    if len(best) >= k:
                        break
            if best:
                return best
        return []

    def commit(self, accepted: int, history: list[int], hidden: mx.array | None = None) -> None:
        self._history = list(history)

    def stop(self) -> None:
        self._history = []


def load_drafter(spec: str, target: Any, vocab_size: int) -> Drafter:
    """``prompt-lookup``, ``demo`` (the shipped draft model), or a local mlx-lm model directory or
    GGUF file (resolved as ``--model`` is, ``resolve_model_path``) whose vocabulary is the target's."""
    if spec == "prompt-lookup":
        return PromptLookup()
    from mlx_lm.utils import load as mlx_load

    from workers.kernels import install
    from workers.models import resolve_model_path

    if spec == "demo":
        from workers.models import demo_path

        path = demo_path("draft")
    else:
        path = resolve_model_path(spec, "--draft")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"--draft {spec!r}: not 'prompt-lookup', 'demo' or a model directory")
    model, _, config = mlx_load(str(path), return_config=True)  # type: ignore[misc]
    install()
    if int(config.get("vocab_size", -1)) != vocab_size:
        raise ValueError(
            f"--draft {spec!r} has a vocabulary of {config.get('vocab_size')} tokens, the target "
            f"{vocab_size}: a draft model must share the target's vocabulary"
        )
    return DraftModel(model, name=f"draft:{path.name}")


class MTPDrafter:
    """The target's MTP head (``workers.models.mtp``): drafts from the target's own hidden states.

    Each round the head takes the hidden states the verify produced for the tokens it committed
    (paired with the token that follows each), then chains itself for the rest of the draft; its
    chained cache entries are speculative and trimmed before the next round. At a burst's start
    the head's cache is rebuilt from a separate target pass over the last ``warmup_tokens`` of the
    history, on a throwaway cache, so the target's serving cache is never touched.
    """

    needs_hidden = True
    fixed_k = True

    def __init__(self, head: Any, target: Any, name: str = "mtp", warmup_tokens: int = 512) -> None:
        self.head = head
        self.target = target
        self.name = name
        self.warmup_tokens = warmup_tokens
        self._cache: list[Any] = []
        self._hidden: mx.array | None = None
        self._next: list[int] = []
        self._drafted = 0
        #: A next proposal computed ahead (``prepare``): its tokens (built, maybe not yet evaluated),
        #: the cache as it was before, and whether this round confirmed it (every draft kept).
        self._prepared: mx.array | None = None
        self._before: tuple[list[tuple[Any, Any, int]], int] | None = None
        self._confirmed = False

    def start(self, history: list[int]) -> None:
        ctx = history[-(self.warmup_tokens + 1) :]
        self._cache = self.head.make_cache()
        scratch = make_prompt_cache(self.target)
        self._hidden = self.target.model(mx.array([ctx[:-1]]), cache=scratch)
        self._next = ctx[1:]

    def propose(self, k: int, sampler: SeededSampler | None) -> Draft:
        return Draft(token_list(self.propose_lazy(k)))

    def propose_lazy(self, k: int) -> mx.array:
        """``propose``'s drafts as a graph not yet evaluated (``[1, k]`` int32), for a round that builds
        its verify on them so that one evaluation computes both (``BurstSettings.draft_in_verify``)."""
        if self._prepared is not None and self._prepared.shape[1] == k:
            ready, self._prepared = self._prepared, None
            return ready
        assert self._hidden is not None
        drafted = self.head.draft(self._hidden, mx.array([self._next]), self._cache, k)
        self._drafted = k
        return drafted

    def prepare(self, hidden: mx.array, drafts: list[int] | mx.array, bonus: mx.array, k: int) -> mx.array:
        """The next proposal if this round keeps every draft, built (not evaluated) on the verify's
        hidden states and its bonus token (``[1, 1]`` int32, not yet known; the drafts may not be
        known yet either, ``[1, K]``): what ``commit`` of all the drafts and then ``propose(k)``
        would compute, on the same arrays. ``confirm`` keeps it
        (``commit`` then does nothing, ``propose`` returns it); ``unprepare`` puts the cache back."""
        self._before = save(self._cache), self._drafted
        trim_prompt_cache(self._cache, self._drafted - 1)
        kept = drafts if isinstance(drafts, mx.array) else mx.array([drafts], dtype=mx.int32)
        tokens = mx.concatenate([kept, bonus], axis=1)
        self._prepared = self.head.draft(hidden[:, : kept.shape[1] + 1], tokens, self._cache, k)
        self._drafted = k
        return self._prepared

    def confirm(self) -> None:
        self._before, self._confirmed = None, True

    def take_prepared(self) -> mx.array | None:
        """The confirmed proposal, not evaluated, handed to the round that verifies it (``propose``
        then drafts afresh)."""
        out, self._prepared = self._prepared, None
        return out

    def unprepare(self) -> None:
        if self._before is not None:
            saved, self._drafted = self._before
            restore(self._cache, saved)
        self._prepared, self._before = None, None

    def commit(self, accepted: int, history: list[int], hidden: mx.array | None = None) -> None:
        if self._confirmed:  # ``prepare`` already did this commit and the next proposal
            self._confirmed = False
            return
        assert hidden is not None, "the MTP head needs the verify's hidden states"
        trim_prompt_cache(self._cache, self._drafted - 1)
        self._hidden = hidden[:, : accepted + 1]
        self._next = history[-(accepted + 1) :]

    def stop(self) -> None:
        self._cache = []
        self._hidden = None
        self._prepared, self._before, self._confirmed = None, None, False


def load_mtp_drafter(spec: str, target: Any) -> Drafter:
    """``demo`` (the shipped head) or a head directory; refused unless trained for ``target``."""
    from workers.models import load_mtp

    path = Path(spec).expanduser()
    if spec == "demo":
        from workers.models import demo_path

        path = demo_path("mtp")
    return MTPDrafter(load_mtp(path, target), target, name=f"mtp:{path.name}")
