"""The GGUF converter on each family it takes: small random models written as llama.cpp writes them
(``tests/helpers/gguf_files``), converted, and run next to the same weights loaded by mlx-lm from a
Hugging Face layout. Equal logits prove the names, the Q/K row order, the config (heads, rope theta,
norm eps, tying) and the carried-over quantization at once."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model, load_tokenizer

from tests.helpers.gguf_files import Shapes, write_family, write_reference
from workers.models.gguf import convert

# (family, tokenizer model): llama with both of llama.cpp's vocabularies, qwen2/qwen3 with BPE.
CASES = [("llama", "llama"), ("llama", "gpt2"), ("qwen2", "gpt2"), ("qwen3", "gpt2")]
ROUND_TRIP = [
    "the cat in a tree",
    "x = 12345 + 0.5; y = 2**10",
    "naïve café — 日本語 🎉",
    "def f(x):\n\treturn x  # ok\n",
    " leading  spaces",
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{t}" for a, t in CASES])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch, tokenizer = request.param
    root = tmp_path_factory.mktemp(f"gguf-{arch}-{tokenizer}")
    weights, config = write_family(root / "model.gguf", arch, tokenizer=tokenizer, seed=3)
    report = convert(root / "model.gguf", root / "converted")
    return {
        "arch": arch,
        "tokenizer": tokenizer,
        "gguf": root / "model.gguf",
        "converted": root / "converted",
        "reference": write_reference(root / "reference", weights, config),
        "report": report,
    }


def test_forward_equals_the_hugging_face_layout(family: dict[str, Any]) -> None:
    converted, _ = load_model(family["converted"])
    reference, _ = load_model(family["reference"])
    ids = mx.array([[5, 17, 40, 3, 99, 120, 7, 8, 200, 11]])
    got, want = np.array(converted(ids)), np.array(reference(ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_config_and_quantization(family: dict[str, Any]) -> None:
    config = json.loads((family["converted"] / "config.json").read_text())
    reference = json.loads((family["reference"] / "config.json").read_text())
    for key in ("model_type", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta"):
        assert config[key] == reference[key], key
    assert config["tie_word_embeddings"] == reference["tie_word_embeddings"]
    assert config["eos_token_id"] == 2
    quant = config["quantization"]
    assert quant["group_size"] == 32
    # The embedding's width differs from the layers' in every family here: it is named on its own.
    assert quant["model.embed_tokens"]["bits"] != quant["bits"]


def test_half_precision_for_gpu_backends(tmp_path: Path) -> None:
    """With float16 asked for (a GPU backend's choice), scales, biases and every vector (norms,
    which llama.cpp stores as F32) are float16; the scales are still the file's, bit for bit."""
    weights, _ = write_family(tmp_path / "m.gguf", "qwen2")
    convert(tmp_path / "m.gguf", tmp_path / "out", dtype=mx.float16)
    kept = mx.load(str(tmp_path / "out" / "model.safetensors"))
    source = mx.load(str(tmp_path / "m.gguf"))
    for name, value in kept.items():
        if value.dtype != mx.uint32:
            assert value.dtype == mx.float16, name
    assert mx.array_equal(kept["model.layers.0.mlp.up_proj.scales"], source["blk.0.ffn_up.scales"])
    assert mx.array_equal(
        kept["model.layers.1.self_attn.q_proj.bias"],
        mx.array(weights["model.layers.1.self_attn.q_proj.bias"]).astype(mx.float16),
    )


def test_bf16_kept_bit_for_bit(tmp_path: Path) -> None:
    """A BF16 matrix (qwen3's output here) is kept as bfloat16 from the file's own bytes (MLX's
    reader would hand it back as float16)."""
    from gguf import GGUFReader

    write_family(tmp_path / "q3.gguf", "qwen3")
    convert(tmp_path / "q3.gguf", tmp_path / "out")
    tensor = next(t for t in GGUFReader(tmp_path / "q3.gguf").tensors if t.name == "output.weight")
    raw = np.asarray(tensor.data).view(np.uint16).reshape(-1)
    kept = mx.load(str(tmp_path / "out" / "model.safetensors"))["lm_head.weight"]
    assert kept.dtype == mx.bfloat16
    assert np.array_equal(np.array(kept.view(mx.uint16)).reshape(-1), raw)


def test_token_round_trip(family: dict[str, Any]) -> None:
    tokenizer = load_tokenizer(family["converted"])
    for text in ROUND_TRIP:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    # Merges apply: "the" is one token in both vocabularies (with SentencePiece's leading "▁").
    assert len(tokenizer.encode(" the" if family["tokenizer"] == "gpt2" else "the", add_special_tokens=False)) == 1
    if family["tokenizer"] == "gpt2":  # both pre-tokenizers here (smollm's, qwen2's) split digits one by one
        assert tokenizer.encode("12 4", add_special_tokens=False) == tokenizer.encode(
            "1", add_special_tokens=False
        ) + tokenizer.encode("2 4", add_special_tokens=False)
        assert len(tokenizer.encode("12 4", add_special_tokens=False)) == 4
    # Special tokens stay whole; the chat template came along.
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    if family["tokenizer"] == "gpt2":
        assert chat[0] == 1 and 2 in chat  # <|im_start|>, <|im_end|>
    assert tokenizer.eos_token_ids == {2}


def test_k_quants_are_requantized_with_the_loss_stated(tmp_path: Path) -> None:
    """Q4_K and Q6_K (which MLX only hands back dequantized) become MLX affine 4 and 6 bits; the
    notice states the loss, and the loss is what it says against llama.cpp's own dequantization."""
    shapes = Shapes(hidden=256, ffn=256, heads=4, kv_heads=2, head_dim=64)
    weights, _ = write_family(tmp_path / "k.gguf", "llama", shapes, mlp=("Q4_K", "Q4_K", "Q6_K"))
    report = convert(tmp_path / "k.gguf", tmp_path / "out")
    (notice,) = report.notices
    assert "4 Q4_K -> 4-bit" in notice and "2 Q6_K -> 6-bit" in notice
    stated = float(re.search(r"error ([\d.]+)%", notice).group(1)) / 100  # type: ignore[union-attr]
    model, _ = load_model(tmp_path / "out")
    err = val = 0.0
    for i, layer in enumerate(model.layers):
        for name, bits in (("gate_proj", 4), ("up_proj", 4), ("down_proj", 6)):
            proj = getattr(layer.mlp, name)
            assert proj.bits == bits
            got = np.array(mx.dequantize(proj.weight, proj.scales, proj.biases, group_size=32, bits=bits))
            want = weights[f"model.layers.{i}.mlp.{name}.weight"]
            err += float(((got - want) ** 2).sum())
            val += float((want**2).sum())
    measured = (err / val) ** 0.5
    assert 0 < measured < 0.05
    assert abs(measured - stated) < 0.0002 + 0.01 * measured


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_decoding_matches_llama_cpp(kind: str, tmp_path: Path) -> None:
    """The converter's own K-quant decoding equals gguf-py's (llama.cpp's reference), value for value."""
    import gguf
    from gguf.quants import dequantize

    from tests.helpers.gguf_files import k_quant_blocks
    from workers.models.gguf import kquants, read_header

    blocks = k_quant_blocks(8, 512, kind, np.random.default_rng(1))
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("x", blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = read_header(tmp_path / "k.gguf").tensors["x"]
    got = kquants.dequantize(tmp_path / "k.gguf", info.offset, info.nbytes, info.shape, kind)
    want = dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(8, 512)
    assert np.array_equal(got, want)


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversion that fails half-way (a full disk) leaves neither the folder nor a partial one."""
    import workers.models.gguf.converter as conversion

    write_family(tmp_path / "m.gguf", "llama")

    def full_disk(folder: Path, weights: dict[str, mx.array]) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(conversion, "_write_weights", full_disk)
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError):
        convert(tmp_path / "m.gguf", tmp_path / "out" / "model")
    assert list((tmp_path / "out").iterdir()) == []


def test_llama3_rope_scaling(tmp_path: Path) -> None:
    """Llama 3.x files carry their rope scaling as a ``rope_freqs`` tensor: recognised, written as
    mlx-lm's ``llama3`` rope, and the forward equals the Hugging Face layout's with that config."""
    weights, config = write_family(
        tmp_path / "m.gguf", "llama", Shapes(head_dim=32, heads=2, kv_heads=1), llama3_rope=8.0
    )
    convert(tmp_path / "m.gguf", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_scaling"] == config["rope_scaling"]
    converted, _ = load_model(tmp_path / "out")
    reference, _ = load_model(write_reference(tmp_path / "ref", weights, config))
    ids = mx.array([list(range(3, 200, 7))])
    np.testing.assert_allclose(np.array(converted(ids)), np.array(reference(ids)), rtol=1e-5, atol=1e-5)


def test_unknown_rope_freqs_are_refused(tmp_path: Path) -> None:
    import gguf

    from tests.helpers.gguf_files import llama3_rope_factors
    from workers.models.gguf import GGUFError

    write_family(tmp_path / "m.gguf", "llama", llama3_rope=8.0)
    reader = gguf.GGUFReader(tmp_path / "m.gguf", "r+")
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    freqs.data[:] = llama3_rope_factors(50000.0, 16, 8.0, 8192)[::-1]  # not Llama 3's curve
    reader.data.flush()
    with pytest.raises(GGUFError, match="not Llama 3's rope scaling"):
        convert(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
