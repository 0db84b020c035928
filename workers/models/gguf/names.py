"""llama.cpp's tensor names to mlx-lm's parameter names, and llama.cpp's Q/K row order undone.

llama.cpp names a llama-style model's tensors ``token_embd``, ``blk.N.attn_q`` and so on; mlx-lm's
llama, qwen2 and qwen3 classes share Hugging Face's names (``model.layers.N.self_attn.q_proj``).
For the ``llama`` architecture llama.cpp's converter also reorders the rows of the query and key
projections, so its interleaved rotary embedding sees the pairs Hugging Face's half-split one does;
``unpermute_rows`` puts them back, which makes the weights mlx-lm's (non-traditional) rope expects.
"""

from __future__ import annotations

import re

import mlx.core as mx

from workers.models.gguf.reader import GGUFError

#: GGUF architectures this converter takes, with the mlx-lm ``model_type`` each becomes.
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

#: Architectures whose Q/K rows llama.cpp's converter permuted.
PERMUTED = {"llama"}

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

#: What each family may hold beyond the llama core, by llama.cpp's per-layer name.
_EXTRA = {"llama": set(), "qwen2": set(), "qwen3": {"attn_q_norm", "attn_k_norm"}}
_CORE = set(_LAYER) - {"attn_q_norm", "attn_k_norm"}

#: Tensors llama.cpp stores that mlx-lm computes itself (``rope_freqs``: checked by the config).
SKIPPED = {"rope_freqs.weight"}

_NAME = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_0-9]+)\.(weight|bias|scales|biases)$")


def module_name(gguf_name: str, arch: str) -> tuple[str, str]:
    """``(module path, parameter)`` in mlx-lm for one GGUF tensor, e.g. ``blk.3.attn_q.scales`` ->
    ``("model.layers.3.self_attn.q_proj", "scales")``; a ``GGUFError`` for a tensor with no place."""
    match = _NAME.match(gguf_name)
    if match is not None:
        layer, base, param = match.groups()
        if layer is None and base in _TOP:
            return _TOP[base], param
        if layer is not None and base in _LAYER and (base in _CORE or base in _EXTRA[arch]):
            return f"model.layers.{int(layer)}.{_LAYER[base]}", param
    raise GGUFError(f"tensor {gguf_name!r} has no place in an mlx-lm {FAMILIES[arch]} model")


def permuted_heads(gguf_name: str, arch: str, heads: int, kv_heads: int) -> int | None:
    """How many heads llama.cpp permuted this tensor's rows over (``None``: not permuted)."""
    if arch not in PERMUTED:
        return None
    base = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if base == "attn_q":
        return heads
    if base == "attn_k":
        return kv_heads
    return None


def unpermute_rows(x: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's ``permute``: within each head it placed the rotary pairs ``(i, i + d/2)``
    next to each other (``reshape(heads, 2, d/2).swapaxes(1, 2)``); this is its inverse. Only rows
    move, so a quantized weight's packed rows, scales and biases permute alike, bit for bit."""
    rows = x.shape[0]
    if rows % (2 * heads):
        raise GGUFError(f"{rows} rows do not split into {heads} heads of rotary pairs")
    rest = tuple(x.shape[1:])
    return x.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def permute_rows(x: mx.array, heads: int) -> mx.array:
    """llama.cpp's own ``permute`` (what its converter does to Hugging Face's Q/K rows): for tests
    and for building GGUF files as llama.cpp would."""
    rows = x.shape[0]
    rest = tuple(x.shape[1:])
    return x.reshape(heads, 2, rows // heads // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)
