"""Loading a target model with mlx-lm, and the facts about it the daemon validates against."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.nn as nn

from workers.kernels import WidthReport, measure_widths

#: Config keys that state a model's trained context, in the order mlx-lm families use them.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")
FALLBACK_CONTEXT = 4096


@dataclass(frozen=True)
class ModelInfo:
    """What the front end needs to validate a request without touching MLX."""

    name: str
    path: str
    model_type: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    #: KV-cache bytes one token of context costs (all layers, keys and values).
    kv_bytes_per_token: int = 0


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict[str, Any]
    info: ModelInfo
    widths: WidthReport


def resolve_model_path(spec: str) -> Path:
    """``demo`` names the embedded default; anything else must be a local model directory
    (nothing is downloaded at run time)."""
    if spec == "demo":
        from workers.demo import demo_path

        return demo_path("target")
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{spec!r} is not a model directory (no config.json). Pass a local mlx-lm model "
            "directory, e.g. one fetched with `huggingface-cli download mlx-community/...`, or 'demo'."
        )
    return path


def _vocab_size(model: nn.Module, config: dict[str, Any]) -> int:
    if "vocab_size" in config:
        return int(config["vocab_size"])
    text = config.get("text_config") or {}
    if "vocab_size" in text:
        return int(text["vocab_size"])
    return int(model.model.embed_tokens.weight.shape[0])


def _context_length(config: dict[str, Any], override: int | None) -> int:
    if override is not None:
        return override
    for source in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(source.get(key), int):
                return int(source[key])
    return FALLBACK_CONTEXT


def kv_bytes_per_token(model: nn.Module) -> int:
    """Measured, not derived from a config: one token through a fresh cache, then the bytes each
    cache holds per slot (caches preallocate in steps, so divide by their capacity)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    total = 0.0
    for c in cache:
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array) and keys.ndim >= 3 and keys.shape[2] > 0:
            total += c.nbytes / keys.shape[2]
    return int(total)


def keep_leading_space(tokenizer: Any) -> None:
    """Make ``tokenizer.detokenizer`` stream a continuation: keep a leading space on the first token.

    Why: mlx-lm's BPE and SPM streaming detokenizers drop the first generated token's leading space,
    as if the output started a document. The daemon's text continues the prompt, so ``prompt + text``
    must read as the decoded sequence and ``text`` must equal ``tokenizer.decode(tokens)`` (for a
    byte-level model whose first token is the indentation of a body, the trim ate a real space).
    The detokenizer prototype is built once per model (its token map spans the vocabulary), so this
    adjusts that prototype; every request copies it.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    proto = getattr(tokenizer, "_detokenizer", None)
    if type(proto) is BPEStreamingDetokenizer:
        proto.__class__ = _continuation_bpe_class()
    elif isinstance(proto, SPMStreamingDetokenizer):
        proto.trim_space = False


@functools.cache
def _continuation_bpe_class() -> type:
    """Built on first use: importing mlx-lm (and transformers) is slow, and this module is imported early."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    class ContinuationBPEDetokenizer(BPEStreamingDetokenizer):
        """mlx-lm's BPE streaming detokenizer without its first-token space trim."""

        def _maybe_trim_space(self, current_text: str) -> str:
            return current_text

    return ContinuationBPEDetokenizer


def load(spec: str, context_length: int | None = None) -> LoadedModel:
    """Load ``spec`` (a directory or ``demo``) with mlx-lm. Call it on the engine thread."""
    from mlx_lm.utils import load as mlx_load

    path = resolve_model_path(spec)
    model, tokenizer, config = cast(tuple[nn.Module, Any, dict[str, Any]], mlx_load(str(path), return_config=True))
    keep_leading_space(tokenizer)
    widths = measure_widths(model)  # also installs the kernel-level patches for this model family
    kv_bytes = kv_bytes_per_token(model)
    info = ModelInfo(
        name=spec if spec == "demo" else path.name,
        path=str(path),
        model_type=str(config.get("model_type", "unknown")),
        vocab_size=_vocab_size(model, config),
        context_length=_context_length(config, context_length),
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        has_chat_template=bool(tokenizer.has_chat_template),
        kv_bytes_per_token=kv_bytes,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, info=info, widths=widths)
