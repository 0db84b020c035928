"""Streamed text continues the prompt: the first generated token keeps its leading space.

mlx-lm's BPE and SPM streaming detokenizers trim that space (as if the output began a document);
``workers.models.loading.keep_leading_space`` turns the trim off, and the daemon loads every model through it.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from tests.helpers.detokenize import DEMO_TARGET
from workers.models.loading import keep_leading_space


def _stream(tokenizer, ids: list[int]) -> str:
    d = tokenizer.detokenizer
    for i in ids:
        d.add_token(i)
    d.finalize()
    return d.text


def test_byte_level_bpe_stream_keeps_the_first_tokens_space() -> None:
    tokenizer = load_tokenizer(DEMO_TARGET)
    keep_leading_space(tokenizer)
    for text in ("    return x\n", " x = 1", " ", "  é日 end"):
        ids = tokenizer.encode(text)
        assert _stream(tokenizer, ids) == text == tokenizer.decode(ids)


def _spm_tokenizer_dir(path: Path) -> Path:
    """A minimal SentencePiece-style tokenizer (Metaspace, byte fallback, the leading-space strip
    decoder) that mlx-lm pairs with its SPM streaming detokenizer."""
    vocab = {"<unk>": 0, "</s>": 1, "▁Paris": 2, "▁is": 3, "▁nice": 4, "▁": 5}
    vocab.update({f"<0x{b:02X}>": 6 + b for b in range(256)})
    spec = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "byte_fallback": True, "unk_token": "<unk>"},
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(spec))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_spm_stream_keeps_the_first_tokens_space(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(_spm_tokenizer_dir(tmp_path / "spm"))
    assert type(tokenizer.detokenizer).__name__ == "SPMStreamingDetokenizer"
    keep_leading_space(tokenizer)
    assert _stream(tokenizer, [2, 3, 4]) == " Paris is nice"  # continues e.g. "The capital of France is"


def test_byte_level_bpe_stream_holds_back_only_an_incomplete_character() -> None:
    """Each token's text is in ``text`` as soon as the token is added (mlx-lm's BPE detokenizer held
    a single-space token back until the next one); only a partial UTF-8 character waits."""
    tokenizer = load_tokenizer(DEMO_TARGET)
    keep_leading_space(tokenizer)
    ids = tokenizer.encode("a  b 1 2\n é日 end ")
    d = tokenizer.detokenizer
    held = 0
    for n, i in enumerate(ids, 1):
        d.add_token(i)
        decoded = tokenizer.decode(ids[:n])
        if decoded.endswith("\ufffd"):
            held += 1
        else:
            assert d.text == decoded, ids[:n]
    assert held and d.text.endswith(" end ")  # the multi-byte characters did wait
