"""The one door to mlx-lm's private internals.

mlx-lm's public API does not give the engine everything it needs, so a few of its private names
are read. Every such read is here and nowhere else in the package: a release that renames or
removes one breaks here, loudly (each accessor raises ``MlxLmChanged`` naming the attribute), and
``tests/engine/test_mlxlm_adapter.py`` runs every accessor on a real ``BatchGenerator`` and tokenizer.

What each one is for, and why the public API is not enough:

- ``decode_batch_size``, ``decoding_uids``: which sequences are in the decode batch.
  ``BatchGenerator`` has no query for a sequence's stage (``extract_cache`` answers for every stage).
- ``prefill_pending``: whether any sequence is queued or prefilling (a burst starts only when none is).
- ``prefill_lengths``: the tokens each queued or prefilling prompt has left, to size the next prefill
  wave by tokens (``workers.engine.prefill_wave``); ``BatchGenerator`` only takes a count of prompts.
- ``pending_token``: the token the decode batch has sampled one step ahead for a sequence, and the
  logprob row it was drawn from. ``remove(..., return_prompt_caches=True)`` gives the cache and the
  tokens in it but drops this token, which pausing and bursts must emit.
- ``batch_classes``: the decode and prefill batch classes, whose ``filter`` the engine replaces
  with one that reads every layer's padding back in one round trip (``batch_filter``); no public
  hook reaches the batches ``BatchGenerator`` makes.
- ``merge_caches``: one batch cache from single-sequence caches, as ``BatchGenerator`` builds them
  (the probe's pin cost and the prefix cache's exactness check run batched forwards themselves).
- ``model_classes``: a config's model and argument classes, to check a model directory without
  reading its weights and to build random-weight models.
- ``detokenizer_prototype``, ``continuation_bpe_class``: the streaming detokenizer every
  ``tokenizer.detokenizer`` copies, and mlx-lm's BPE one without its first-token space trim and
  without holding a single-space token back (an override of a private method and a read of its
  private buffer, which would silently do nothing if they were renamed).

mlx-lm is imported on first use, not here: ``workers.models.loading`` imports this module early and
importing mlx-lm (and transformers) takes a second. Its modules are reached with ``import_module``:
the package's ``generate`` attribute is the function, not the module.
"""

from __future__ import annotations

import functools
import logging
import re
from importlib import import_module, metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx

log = logging.getLogger("mlx_batchd.engine")

#: The mlx-lm release the accessors were written against and checked on.
WRITTEN_AGAINST = "0.32.2"
#: The releases they are meant for: ``[low, high)``, the range pyproject.toml pins.
SUPPORTED = ((0, 32, 2), (0, 33))


class MlxLmChanged(RuntimeError):
    """An mlx-lm internal this module reads is gone or renamed: the installed mlx-lm is not one the
    adapter was written for."""


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric components of a version string: ``"0.33.0.dev1"`` -> ``(0, 33, 0)``."""
    parts: list[int] = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(parts)


def installed_version() -> str:
    """The installed mlx-lm's version, read from its package metadata (no import of mlx-lm)."""
    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        return "unknown"


def supported(version: str) -> bool:
    """Whether ``version`` is in ``SUPPORTED``."""
    low, high = SUPPORTED
    return low <= version_tuple(version) < high


def _range() -> str:
    low, high = SUPPORTED
    return f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"


def _changed(owner: Any, name: str) -> MlxLmChanged:
    where = owner.__name__ if isinstance(owner, type) else getattr(owner, "__name__", type(owner).__name__)
    return MlxLmChanged(
        f"mlx-lm {installed_version()} has no {where}.{name}: workers/kernels/mlxlm.py was written against mlx-lm "
        f"{WRITTEN_AGAINST} (supported {_range()}); install a supported mlx-lm or adapt the accessor that reads it"
    )


def _get(owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _changed(owner, name) from None


if not supported(installed_version()):
    log.warning(
        "mlx-lm %s is outside the releases workers/kernels/mlxlm.py was written for (%s); "
        "tests/engine/test_mlxlm_adapter.py says whether its internals still fit",
        installed_version(),
        _range(),
    )


# --------------------------------------------------------------------------- BatchGenerator


def decode_batch_size(gen: Any) -> int:
    """Sequences in ``gen``'s decode batch (prefilled, sampling a token per step)."""
    return len(_get(gen, "_generation_batch"))


def decoding_uids(gen: Any) -> list[int]:
    """The uids in ``gen``'s decode batch, in batch order (do not mutate)."""
    uids: list[int] = _get(gen, "_generation_batch").uids
    return uids


def prefill_pending(gen: Any) -> bool:
    """Whether ``gen`` holds a sequence still queued for prefill or prefilling."""
    return bool(_get(gen, "_unprocessed_sequences")) or len(_get(gen, "_prompt_batch")) > 0


def prefill_lengths(gen: Any) -> tuple[list[int], list[int]]:
    """The next prefill chunk's source for each prompt of ``gen``: the tokens left in the current
    segment of every prompt prefilling now, and of every prompt queued (in queue order)."""

    def left(segments: list[Any]) -> int:
        return len(segments[0]) if segments else 0

    prefilling = [left(entry[0]) for entry in _get(gen, "_currently_processing")]
    queued = [left(entry[1]) for entry in _get(gen, "_unprocessed_sequences")]
    return prefilling, queued


def pending_token(gen: Any, uid: int) -> tuple[mx.array, mx.array]:
    """The token ``gen`` has sampled one step ahead for decoding sequence ``uid`` (neither emitted
    nor fed to the model yet) and the logprob row it was drawn from; both lazy."""
    batch = _get(gen, "_generation_batch")
    idx = batch.uids.index(uid)
    return _get(batch, "_next_tokens")[idx], _get(batch, "_next_logprobs")[idx]


def batch_classes() -> list[type]:
    """mlx-lm's decode and prefill batch classes (each has ``filter(keep)`` and ``prompt_cache``)."""
    generate = import_module("mlx_lm.generate")
    classes: list[type] = [_get(generate, "GenerationBatch"), _get(generate, "PromptProcessingBatch")]
    for cls in classes:
        _get(cls, "filter")
    return classes


# --------------------------------------------------------------------------- caches, models, tokenizers


def merge_caches(caches: list[list[Any]]) -> list[Any]:
    """One batch cache (one entry per layer) holding each single-sequence cache of ``caches`` as a row."""
    merged: list[Any] = _get(import_module("mlx_lm.generate"), "_merge_caches")(caches)
    return merged


def model_classes(config: dict[str, Any]) -> tuple[type[Any], type[Any]]:
    """The model class and its argument class for ``config``; ``ValueError`` when mlx-lm does not
    know its ``model_type``."""
    model_class, args_class = _get(import_module("mlx_lm.utils"), "_get_classes")(config)
    return model_class, args_class


def detokenizer_prototype(tokenizer: Any) -> Any:
    """The streaming detokenizer of an mlx-lm ``TokenizerWrapper`` that ``tokenizer.detokenizer``
    copies for each caller: a change to it reaches every later copy."""
    return _get(tokenizer, "_detokenizer")


@functools.cache
def continuation_bpe_class() -> type:
    """mlx-lm's BPE streaming detokenizer without its first-token space trim, sending each token's
    text as soon as it is whole."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    _get(BPEStreamingDetokenizer, "_maybe_trim_space")  # the overrides below replace or extend them
    _get(BPEStreamingDetokenizer, "_decode_bytes")

    class ContinuationBPEDetokenizer(BPEStreamingDetokenizer):
        """mlx-lm's BPE streaming detokenizer without its first-token space trim, and holding back
        only an incomplete UTF-8 character: mlx-lm's holds a single-space token until the next
        token arrives, to trim it if it starts the text; with no trim that space is final at once
        (SmolLM's digit-splitting tokenizer makes one before every number)."""

        def _maybe_trim_space(self, current_text: str) -> str:
            return current_text

        def add_token(self, token: int) -> None:
            super().add_token(token)
            held = self._decode_bytes(_get(self, "_unflushed"))
            if held and not held.endswith("\ufffd"):
                self.text += held
                self._unflushed = ""

    return ContinuationBPEDetokenizer
