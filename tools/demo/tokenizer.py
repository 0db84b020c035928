"""Byte-level tokenizer for the demo models, in the on-disk layout mlx-lm's loader accepts.

The shipped models use 257 tokens: the 256 bytes and ``<|endoftext|>``. It is written as a byte-level
BPE with no merges, so mlx-lm recognises the ``ByteLevel`` decoder and picks its streaming BPE
detokenizer (which holds back incomplete UTF-8 sequences). Why bytes rather than a fitted vocabulary:
every prompt round-trips with no boundary effects (a BPE that glues a newline to the indentation after
it makes a prompt ending in a bare newline look unlike anything seen in training); the 8.2M-token
corpus is 28M byte tokens, which a small model overfits far less; and per-token prediction is easier
for the drafters, which is what speculative decoding is measured on (docs/demo-models.md has the
comparison with the first shipped set's 4096-entry BPE). A larger ``vocab_size`` fits a byte-level BPE
of that size instead.

The only special token is ``<|endoftext|>`` (id 0): it separates files in training and is the EOS.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
# 256 byte tokens + EOS: a "BPE" with no merges, i.e. a byte-level tokenizer in the same file format.
BYTE_VOCAB_SIZE = 257

# A plain chat template: the demo models only ever saw Python source, so a conversation is rendered as
# Python comments and the reply starts on a fresh line. It exists so chat-style requests still work.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% for line in message['content'].split('\n') %}# {{ message['role'] }}: {{ line }}\n{% endfor %}"
    "{% endfor %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Fit a byte-level BPE of ``vocab_size`` entries (``<|endoftext|>`` included) on ``texts``.

    ``BYTE_VOCAB_SIZE`` leaves no room for merges: the result is the plain byte tokenizer. Deterministic
    for the same texts in the same order. ``add_prefix_space`` is off so that encoding a prompt and
    decoding it gives the prompt back byte for byte.
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
