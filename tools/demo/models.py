"""The demo models' shapes and their mlx-lm llama arguments, the draft cut from the target, and saving
what ships (bf16, mlx-lm's layout).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from tools.demo.tokenizer import BYTE_VOCAB_SIZE, save_tokenizer

# Byte-level: 256 byte tokens + EOS, no merges (see tools/demo/tokenizer.py for why). A larger value
# fits a byte-level BPE of that many entries instead (the first shipped set used 4096).
VOCAB_SIZE = BYTE_VOCAB_SIZE
# Training context: the evaluation prompts carry ~1200 bytes of their file before the def line, and a
# continuation of 256 bytes must still sit inside the positions the model was trained on.
SEQ_LEN = 1536
# Sizes chosen for a 2-core CPU with MLX's reference BLAS (docs/demo-models.md has the measurements):
# the target must decode >= 50 tok/s in bf16 at B = 1, and all weights must fit in 25 MB.
# --target-layers overrides the depth.
TARGET_SHAPE = dict(hidden_size=256, num_hidden_layers=6, intermediate_size=704, num_attention_heads=4)
# --draft-init scratch only; the default draft is the target's shape cut to --draft-layers blocks.
DRAFT_SHAPE = dict(hidden_size=192, num_hidden_layers=2, intermediate_size=512, num_attention_heads=3)
MTP_LAYERS = 1
# --smoke: tiny shapes so the whole pipeline runs on a CPU in seconds (tests of this script only).
SMOKE_SHAPES = (
    dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2),
    dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=1),
)


def llama_args(vocab_size: int, shape: dict) -> llama.ModelArgs:
    """mlx-lm llama arguments for one of our shapes (tied embeddings: half the table bytes)."""
    return llama.ModelArgs(
        model_type="llama",
        vocab_size=vocab_size,
        num_key_value_heads=shape["num_attention_heads"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **shape,
    )


def llama_config_json(args: llama.ModelArgs, eos_id: int) -> dict:
    """``config.json`` for mlx-lm (and transformers) from the model arguments."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def draft_from_target(target: llama.Model, target_shape: dict, layers: int) -> tuple[llama.Model, dict]:
    """A draft that starts as an early exit of ``target``: its embedding, first ``layers`` blocks, final norm.

    Why: acceptance is agreement with the target, and the target's own lower blocks plus its output head
    already agree with it far more than a randomly initialised model of the same size; distillation then
    only has to close the gap. Weights are copied as float32 for training (the target is bf16 by then).
    """
    shape = dict(target_shape, num_hidden_layers=min(layers, target_shape["num_hidden_layers"]))
    draft = llama.Model(llama_args(target.args.vocab_size, shape))
    keep = []
    for name, value in tree_flatten(target.parameters()):
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= shape["num_hidden_layers"]:
            continue
        keep.append((name, value.astype(mx.float32)))
    draft.load_weights(keep, strict=True)
    return draft, shape


def as_shipped(module: nn.Module) -> None:
    """Cast a trained module to bf16 in eval mode, evaluated: what ships, and what later phases read."""
    module.set_dtype(mx.bfloat16)
    module.eval()
    mx.eval(module.parameters())


def n_params(module: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()))


def save_llama(model: llama.Model, out_dir: Path, tokenizer, eos_id: int) -> None:
    """Write an mlx-lm model directory: config, bf16 safetensors, tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(llama_config_json(model.args, eos_id), indent=2) + "\n")
    save_tokenizer(tokenizer, out_dir, model_max_length=model.args.max_position_embeddings)
