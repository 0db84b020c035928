"""Byte-level BPE tokenizer for the demo models, in the on-disk layout mlx-lm's loader accepts.

Why byte-level BPE: every byte sequence round-trips (no unknown tokens, so any prompt works), and
mlx-lm recognises the ``ByteLevel`` decoder and picks its streaming BPE detokenizer for it. Why train
our own instead of shipping a known vocabulary: the demo must work offline, and a 4096-entry vocabulary
fitted to Python source keeps the embedding table (and so the committed weights) small.

The only special token is ``<|endoftext|>`` (id 0): it separates files in training and is the EOS.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"

# A plain chat template: the demo models only ever saw Python source, so a conversation is rendered as
# Python comments and the reply starts on a fresh line. It exists so chat-style requests still work.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% for line in message['content'].split('\n') %}# {{ message['role'] }}: {{ line }}\n{% endfor %}"
    "{% endfor %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Fit a byte-level BPE of ``vocab_size`` entries (``<|endoftext|>`` included) on ``texts``.

    Deterministic for the same texts in the same order. ``add_prefix_space`` is off so that encoding a
    prompt and decoding it gives the prompt back byte for byte.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_as_iterator(texts), trainer=trainer)
    assert tok.token_to_id(EOS_TOKEN) == 0, "EOS must be id 0"
    return tok


def _as_iterator(texts: Iterable[str]) -> Iterator[str]:
    yield from texts


def tokenizer_config(model_max_length: int) -> dict:
    """The ``tokenizer_config.json`` that lets ``transformers``' fast tokenizer (and so mlx-lm) load us."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into a model directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
