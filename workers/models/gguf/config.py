"""mlx-lm's ``config.json`` from a GGUF file's metadata (``{arch}.*`` keys) and tensor shapes."""

from __future__ import annotations

import math
from typing import Any, cast

import mlx.core as mx

from workers.models.gguf.names import FAMILIES
from workers.models.gguf.reader import GGUFError, Header

Metadata = dict[str, Any]


def plain(value: Any) -> Any:
    """A metadata value as Python: MLX hands scalars back as 0-d arrays and vectors as arrays."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def family(metadata: Metadata, name: str) -> str:
    """The file's architecture, or a ``GGUFError`` naming it when it is not one converted here."""
    arch = plain(metadata.get("general.architecture"))
    if not isinstance(arch, str):
        raise GGUFError(f"{name}: no general.architecture in its metadata (not a model file?)")
    if arch not in FAMILIES:
        raise GGUFError(f"{name}: architecture {arch!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    return arch


def _get(metadata: Metadata, key: str, default: Any = None, required: bool = False, name: str = "") -> Any:
    value = plain(metadata.get(key, default))
    if value is None and required:
        raise GGUFError(f"{name}: {key} is missing from its metadata")
    return value


def llama3_factors(freq_base: float, head_dim: int, factor: float, original: int) -> list[float]:
    """The per-frequency factors llama.cpp stores as ``rope_freqs`` for Llama 3's rope scaling
    (low frequency factor 1, high 4: the values every Llama 3.x checkpoint uses)."""
    low, high = 1.0, 4.0
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * freq_base ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _rope_scaling(metadata: Metadata, arch: str, head_dim: int, theta: float, freqs: mx.array | None, name: str) -> Any:
    """mlx-lm's ``rope_scaling``: linear from the metadata, Llama 3's recognised from ``rope_freqs``."""
    kind = _get(metadata, f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise GGUFError(f"{name}: rope scaling {kind!r} is not supported (none and linear are, and Llama 3's)")
    if kind == "linear":
        return {"type": "linear", "factor": float(_get(metadata, f"{arch}.rope.scaling.factor", 1.0))}
    if freqs is None:
        return None
    stored = [float(x) for x in cast(list[float], freqs.astype(mx.float32).tolist())]
    factor = max(stored)
    original = int(_get(metadata, f"{arch}.rope.scaling.original_context_length", 8192))
    expected = llama3_factors(theta, head_dim, factor, original)
    if len(expected) != len(stored) or any(abs(a - b) > 1e-3 * max(1.0, b) for a, b in zip(expected, stored)):
        raise GGUFError(f"{name}: its rope_freqs are not Llama 3's rope scaling; this converter takes no other")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }


def build_config(metadata: Metadata, header: Header, freqs: mx.array | None, name: str) -> dict[str, Any]:
    """``config.json`` for the file's family; ``quantization`` and the token ids are added by the
    caller. ``freqs`` is the ``rope_freqs`` tensor if the file has one."""
    arch = family(metadata, name)

    def need(key: str) -> Any:
        return _get(metadata, f"{arch}.{key}", required=True, name=name)

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(_get(metadata, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_get(metadata, f"{arch}.attention.key_length", hidden // heads))
    theta = float(_get(metadata, f"{arch}.rope.freq_base", 10000.0))
    embed = header.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{name}: no token_embd.weight tensor (not a complete model file)")
    config: dict[str, Any] = {
        "model_type": FAMILIES[arch],
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
        ],
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(metadata, arch, head_dim, theta, freqs, name),
        "vocab_size": int(embed.shape[0]),
        "max_position_embeddings": int(_get(metadata, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in header.tensors,
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    return config
