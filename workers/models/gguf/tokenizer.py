"""A Hugging Face ``tokenizer.json`` and ``tokenizer_config.json`` from a GGUF file's metadata.

Two vocabularies llama.cpp writes are rebuilt: ``gpt2`` (byte-level BPE: tokens, merges, and the
pre-tokenizer ``tokenizer.ggml.pre`` names, e.g. SmolLM's digits split one by one) and ``llama``
(SentencePiece: tokens and scores, merges recovered from the scores the way Hugging Face's own
converter does, byte fallback). Control and user-defined tokens become added tokens; the chat
template, BOS/EOS and the end-of-turn tokens go to ``tokenizer_config.json`` and the ids that end a
generation to the caller, for ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.models.gguf.config import Metadata, plain
from workers.models.gguf.reader import GGUFError

# llama.cpp's token types.
_NORMAL, _UNKNOWN, _CONTROL, _USER, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` values by the split they name (llama.cpp's ``llama-vocab.cpp``).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"}
_LLAMA3_PRE = {"llama3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral", "llama4"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen", "megrez", "hunyuan"}
_GPT2_PRE = {"default", "gpt-2", "gpt2", "phi-2", "olmo", "jina-es"}


@dataclass
class TokenizerFiles:
    tokenizer: dict[str, Any]  # tokenizer.json
    config: dict[str, Any]  # tokenizer_config.json
    bos_token_id: int | None
    eos_token_ids: list[int]
    notice: str | None = None  # a caveat to print, e.g. an unknown pre-tokenizer


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def pre_tokenizer(pre: str | None) -> tuple[dict[str, Any], str | None]:
    """The pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` value, and a notice when the value
    is not one known here (GPT-2's split is used then; token boundaries may differ)."""
    if pre in _DIGITS_THEN_GPT2:
        digits = {"type": "Digits", "individual_digits": True}
        return {"type": "Sequence", "pretokenizers": [digits, _byte_level(True)]}, None
    if pre in _LLAMA3_PRE:
        return {"type": "Sequence", "pretokenizers": [_split(_LLAMA3), _byte_level(False)]}, None
    if pre in _QWEN2_PRE:
        return {"type": "Sequence", "pretokenizers": [_split(_QWEN2), _byte_level(False)]}, None
    notice = None
    if pre not in _GPT2_PRE and pre is not None:
        notice = f"pre-tokenizer {pre!r} is not known here; GPT-2's split is used (token boundaries may differ)"
    return _byte_level(True), notice


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """Merges for a SentencePiece BPE vocabulary, recovered as Hugging Face's converter does: every
    split of a piece into two pieces of the vocabulary, ordered by the merged piece's score."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER)}
    found: list[tuple[str, str, float]] = []
    for piece, score in sorted(((t, scores[i]) for t, i in vocab.items()), key=lambda x: vocab[x[0]]):
        local = [
            (piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: m[2], reverse=True)
    return [[left, right] for left, right, _ in found]


def _added(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind in (_CONTROL, _UNKNOWN),
        }
        for i, kind in enumerate(types)
        if kind in (_CONTROL, _USER, _UNKNOWN)
    ]


def _post_processor(bos: str | None, bos_id: int | None, add_bos: bool) -> dict[str, Any] | None:
    if not add_bos or bos is None or bos_id is None:
        return None
    head = [{"SpecialToken": {"id": bos, "type_id": 0}}]
    return {
        "type": "TemplateProcessing",
        "single": [*head, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [*head, {"Sequence": {"id": "A", "type_id": 0}}, *head, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def build_tokenizer(metadata: Metadata, context_length: int, name: str) -> TokenizerFiles:
    """Both tokenizer files for the file's vocabulary, or a ``GGUFError`` when it has none."""
    model = plain(metadata.get("tokenizer.ggml.model"))
    tokens = plain(metadata.get("tokenizer.ggml.tokens"))
    if not isinstance(model, str) or not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{name}: no tokenizer in its metadata (tokenizer.ggml.model and .tokens are needed)")
    types = plain(metadata.get("tokenizer.ggml.token_type")) or [_NORMAL] * len(tokens)

    def token_id(key: str) -> int | None:
        value = plain(metadata.get(f"tokenizer.ggml.{key}"))
        return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

    bos_id, eos_id, unk_id, pad_id = (
        token_id(k) for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    )
    add_bos = bool(plain(metadata.get("tokenizer.ggml.add_bos_token", model == "llama")))
    add_eos = bool(plain(metadata.get("tokenizer.ggml.add_eos_token", False)))
    bos = tokens[bos_id] if bos_id is not None else None
    notice = None
    if model == "gpt2":
        merges = plain(metadata.get("tokenizer.ggml.merges"))
        if not isinstance(merges, list):
            raise GGUFError(f"{name}: its BPE tokenizer has no merges (tokenizer.ggml.merges)")
        pre_name = plain(metadata.get("tokenizer.ggml.pre"))
        pre, notice = pre_tokenizer(pre_name)
        body: dict[str, Any] = {
            "normalizer": None,
            "pre_tokenizer": pre,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": pre_name in _LLAMA3_PRE,  # as Llama 3's own tokenizer.json says
                "vocab": {t: i for i, t in enumerate(tokens)},
                "merges": [m.split(" ", 1) for m in merges],
            },
        }
    elif model == "llama":
        scores = plain(metadata.get("tokenizer.ggml.scores"))
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise GGUFError(f"{name}: its SentencePiece tokenizer has no scores (tokenizer.ggml.scores)")
        space = bool(plain(metadata.get("tokenizer.ggml.add_space_prefix", True)))
        decoders: list[dict[str, Any]] = [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]
        if space:
            decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        # As llama.cpp does: a space before every text fragment (the start, and after each special
        # token), then every space as "\u2581" (Hugging Face's legacy Llama normalizer says the same).
        normalizers: list[dict[str, Any]] = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
        if space:
            normalizers.insert(0, {"type": "Prepend", "prepend": "\u2581"})
        body = {
            "normalizer": {"type": "Sequence", "normalizers": normalizers},
            "pre_tokenizer": None,
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": tokens[unk_id] if unk_id is not None else None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": True,
                "byte_fallback": True,
                "ignore_merges": False,
                "vocab": {t: i for i, t in enumerate(tokens)},
                "merges": spm_merges(tokens, [float(s) for s in scores], types),
            },
        }
    else:
        raise GGUFError(f"{name}: tokenizer model {model!r} is not supported (gpt2 and llama are)")
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(tokens, types),
        "post_processor": _post_processor(bos, bos_id, add_bos),
        **body,
    }
    ends = [i for i in (eos_id, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
    eos_ids = list(dict.fromkeys(ends))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": tokens[eos_id] if eos_id is not None else None,
        "unk_token": tokens[unk_id] if unk_id is not None else None,
        "pad_token": tokens[pad_id] if pad_id is not None else None,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
    }
    template = plain(metadata.get("tokenizer.chat_template"))
    if isinstance(template, str):
        config["chat_template"] = template
    return TokenizerFiles(tokenizer, config, bos_id, eos_ids, notice)
