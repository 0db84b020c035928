"""Random-weight models built from mlx-lm configs, saved as ordinary model directories.

Tests, benchmarks and the GPU measurements need real mlx-lm models without downloading
weights: a config, a fixed seed and a byte-level tokenizer make one. The directory written here
loads with ``mlx_lm.load`` like any mlx-community checkpoint, so everything downstream of
loading is exercised for real.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from workers.kernels import model_classes

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
EOS_TOKEN = SPECIAL_TOKENS[0]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BYTE_VOCAB = len(SPECIAL_TOKENS) + 256


def _filler_tokens(alphabet: list[str], count: int) -> list[str]:
    """Distinct multi-character strings for ids past the 256 bytes.

    A model's vocabulary is often far larger than a byte tokenizer's (the 8B-shaped llama has
    128256 rows). Every id must still decode, so the tokenizer gets filler entries: pairs, then
    triples of byte characters. Encoding never produces them (there are no merges); decoding
    maps each to its bytes.
    """
    out: list[str] = []
    for a in alphabet:
        for b in alphabet:
            if len(out) == count:
                return out
            out.append(a + b)
    for a in alphabet:
        for b in alphabet:
            for c in alphabet:
                if len(out) == count:
                    return out
                out.append(a + b + c)
    return out


def write_byte_tokenizer(path: Path, vocab_size: int, context_length: int) -> None:
    """A byte-level BPE tokenizer (no merges) with ``vocab_size`` ids and a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < BYTE_VOCAB:
        raise ValueError(f"vocab_size must be >= {BYTE_VOCAB} for a byte tokenizer")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    for filler in _filler_tokens(alphabet, vocab_size - len(vocab)):
        vocab[filler] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL_TOKENS])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "model_max_length": context_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_model(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """Instantiate an mlx-lm model from a config with seeded random weights.

    ``config`` is an mlx-lm ``config.json`` map; ``torch_dtype`` sets the weights' dtype and a
    ``quantization`` entry ({"group_size", "bits"}) quantizes them as mlx-lm's converter would.
    """
    model_class, args_class = model_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    dtype = getattr(mx, config.get("torch_dtype", "bfloat16"))
    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))
    if "synth_branch_scale" in config:
        scale_branch_outputs(model, float(config["synth_branch_scale"]))
    if "quantization" in config:
        q = config["quantization"]
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"])
    mx.eval(model.parameters())
    return model


#: Projections that write a layer's output back into the residual stream (llama, qwen3, gemma3).
BRANCH_OUTPUTS = ("o_proj", "down_proj")


def scale_branch_outputs(model: nn.Module, scale: float) -> None:
    """Multiply every residual branch's output projection by ``scale``.

    Why: a random-weight model's greedy output rarely repeats, so prompt lookup has nothing to
    draft on it. With the branches scaled down and the embeddings tied, the final hidden state is
    close to the last token's own embedding, whose dot product with itself beats every other row:
    greedy decoding repeats the prompt's last token. The shapes, dtypes and quantization are the
    preset's, so a step costs what it costs on the unscaled model; only the tokens change.
    """
    updates = [
        (f"{name}.weight", module.weight * scale)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in BRANCH_OUTPUTS and "weight" in module
    ]
    if not updates:
        raise ValueError("synth_branch_scale: the model has no o_proj/down_proj to scale")
    model.load_weights(updates, strict=False)


def write_model(path: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Write a loadable model directory (config, safetensors, tokenizer) and return ``path``."""
    from mlx_lm.utils import save_config, save_model

    config = dict(config)
    model = build_model(config, seed)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    write_byte_tokenizer(path, config["vocab_size"], config.get("max_position_embeddings", 4096))
    return path


#: How far ``echo`` configs scale the residual branches: with mlx's default initialisations a
#: layer's branch is several times the embedding's norm (6.6x at width 1,024, 4-bit); scaled, 0.7 % of it.
ECHO_BRANCH_SCALE = 1e-3


def llama_config(
    hidden: int = 256,
    layers: int = 4,
    ffn: int = 768,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = BYTE_VOCAB,
    context: int = 4096,
    dtype: str = "bfloat16",
    quant_bits: int | None = None,
    echo: bool = False,
) -> dict[str, Any]:
    """A llama config; the defaults are the tiny placeholder demo, ``llama_config(4096, 32,
    14336, 32, 8, 128256, quant_bits=4)`` is the 8B shape the GPU benchmarks use (docs/benchmarks.md).
    ``echo`` ties the embeddings and scales the residual branches down (``scale_branch_outputs``):
    the same shapes, a greedy output that repeats the prompt's last token."""
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "rope_theta": 500000.0,
        "tie_word_embeddings": echo or vocab == BYTE_VOCAB,
        "torch_dtype": dtype,
    }
    if quant_bits is not None:
        config["quantization"] = {"group_size": 64, "bits": quant_bits}
    if echo:
        config["synth_branch_scale"] = ECHO_BRANCH_SCALE
    return config


def gemma3_config(
    hidden: int = 128,
    layers: int = 4,
    window: int = 64,
    pattern: int = 2,
    dtype: str = "float32",
    vocab: int = BYTE_VOCAB,
) -> dict[str, Any]:
    """A gemma3-text config with sliding-window layers (rotating KV caches)."""
    return {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "head_dim": hidden // 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "sliding_window": window,
        "sliding_window_pattern": pattern,
        "max_position_embeddings": 4096,
        "query_pre_attn_scalar": hidden // 4,
        "torch_dtype": dtype,
    }


def qwen3_config(
    hidden: int = 128, layers: int = 2, experts: int = 0, dtype: str = "bfloat16", vocab: int = BYTE_VOCAB
) -> dict[str, Any]:
    """A qwen3 config; ``experts > 0`` makes it qwen3_moe (switch layers, 2 experts per token)."""
    config: dict[str, Any] = {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
    }
    if experts:
        config.update(
            model_type="qwen3_moe",
            num_experts=experts,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=hidden,
            norm_topk_prob=True,
        )
    return config


#: Named configs for ``mlx-batchd synth``; the GPU measurements use ``llama-8b-4bit``.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": llama_config(),
    "llama-8b-4bit": llama_config(4096, 32, 14336, 32, 8, 128256, context=8192, quant_bits=4),
    # The same shapes with a greedy output that repeats itself: prompt lookup's workload.
    "llama-8b-4bit-echo": llama_config(4096, 32, 14336, 32, 8, 128256, context=8192, quant_bits=4, echo=True),
    # A drafter for it: the same vocabulary, about a tenth of the compute.
    "llama-1b-4bit": llama_config(2048, 8, 8192, 16, 8, 128256, context=8192, quant_bits=4),
    "gemma3-sliding-f32": gemma3_config(),
    "qwen3-tiny": qwen3_config(),
    "qwen3-moe-tiny": qwen3_config(experts=4, dtype="float32"),  # MLX CPU gather_mm is f32-only
    "mistral-tiny": {**llama_config(), "model_type": "mistral"},
}


class PresetError(ValueError):
    """An unknown ``mlx-batchd synth --preset`` name; the message lists the known ones."""


def preset(name: str) -> dict[str, Any]:
    """The config named ``name`` in ``PRESETS``, or a ``PresetError`` that says which names exist."""
    try:
        return PRESETS[name]
    except KeyError:
        raise PresetError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
