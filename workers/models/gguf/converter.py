"""One GGUF file to one mlx-lm model folder, written whole or not at all.

Everything that can refuse the file (its header, tensor types, architecture, tokenizer) is checked
before a weight is converted, and the folder is written under a temporary name beside its target
and renamed into place at the end, so a failure or an interruption leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from workers.models.gguf.config import build_config, family, plain
from workers.models.gguf.names import SKIPPED, module_name
from workers.models.gguf.reader import GGUFError, Header, read_header
from workers.models.gguf.tokenizer import build_tokenizer
from workers.models.gguf.weights import CARRIED, REQUANTIZED, convert_weights, refused_types, scales_dtype

#: Written beside the weights: where the folder came from (the name a daemon reports, the hash).
SOURCE_FILE = "gguf_source.json"


@dataclass
class Report:
    """What a conversion did, for the command line to print."""

    out: Path
    architecture: str
    quantization: dict[str, Any] | None
    scales_dtype: str
    notices: list[str] = field(default_factory=list)


def _write_weights(folder: Path, weights: dict[str, mx.array]) -> None:
    from mlx_lm.utils import make_shards

    shards = make_shards(weights)
    if len(shards) == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return
    index: dict[str, Any] = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": {}}
    for i, shard in enumerate(shards):
        shard_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(folder / shard_name), shard, metadata={"format": "mlx"})
        index["weight_map"].update(dict.fromkeys(shard, shard_name))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _load(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    try:
        loaded = mx.load(str(path), format="gguf", return_metadata=True)  # an Ollama blob has no suffix
    except (RuntimeError, ValueError) as exc:
        raise GGUFError(f"{path.name}: MLX cannot read it ({' '.join(str(exc).split())})") from None
    tensors, metadata = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    return tensors, metadata


def preflight(path: Path) -> Header:
    """What refuses a file, found from its header alone (no tensor read): corrupt or truncated,
    tensor types not taken, an architecture not converted, a tensor with no place in the family's
    model, no tokenizer."""
    name = path.name
    header = read_header(path)
    refused = refused_types(header)
    if refused:
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(refused.items()))
        raise GGUFError(
            f"{name}: tensor type {kinds} cannot be converted (taken: {', '.join([*CARRIED, *REQUANTIZED])}, "
            "F16, BF16, F32); pick a Q4_0, Q4_1, Q8_0 or Q4_K_M file of the model"
        )
    arch = family({"general.architecture": header.architecture}, name)
    for tensor in header.tensors:
        if tensor not in SKIPPED:
            try:
                module_name(tensor, arch)
            except GGUFError as exc:
                raise GGUFError(f"{name}: {exc}") from None
    if not {"tokenizer.ggml.model", "tokenizer.ggml.tokens"} <= header.keys:
        raise GGUFError(f"{name}: no tokenizer in its metadata (tokenizer.ggml.model and .tokens are needed)")
    return header


def convert(
    path: Path,
    out: Path,
    dtype: mx.Dtype | None = None,
    progress: bool = False,
    source: dict[str, Any] | None = None,
) -> Report:
    """Convert ``path`` into the folder ``out`` (which must not exist yet; it appears whole).

    ``dtype``: the scales' and vectors' dtype (``weights.scales_dtype``: float32 on the CPU, float16
    on a GPU); ``source``: extra facts for ``gguf_source.json`` (the file's hash)."""
    name = path.name
    header = preflight(path)
    tensors, metadata = _load(path)
    arch = family(metadata, name)
    config = build_config(metadata, header, tensors.get("rope_freqs.weight"), name)
    tok = build_tokenizer(metadata, int(config["max_position_embeddings"]), name)
    dtype = dtype if dtype is not None else scales_dtype()
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    try:
        converted = convert_weights(path, header, tensors, arch, heads, kv_heads, dtype, progress=progress)
    except GGUFError as exc:
        raise GGUFError(f"{name}: {exc}") from None
    del tensors
    quantization = converted.quantization()
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    if tok.bos_token_id is not None:
        config["bos_token_id"] = tok.bos_token_id
    if tok.eos_token_ids:
        config["eos_token_id"] = tok.eos_token_ids[0] if len(tok.eos_token_ids) == 1 else tok.eos_token_ids
    dtype_name = str(dtype).removeprefix("mlx.core.")
    notices = [tok.notice] if tok.notice else []
    if converted.requantized:
        kinds = ", ".join(f"{n} {k} -> {REQUANTIZED[k]}-bit" for k, n in sorted(converted.requantized.items()))
        notices.append(
            f"re-quantized {kinds} tensors to MLX affine (group 32): relative RMS error "
            f"{converted.requant_error:.2%} against the file's own values"
        )
    facts = {
        "file": name,
        "architecture": arch,
        "general.name": plain(metadata.get("general.name")),
        "scales_dtype": dtype_name,
    }
    _publish(out, config, tok.tokenizer, tok.config, converted.weights, {**facts, **(source or {})})
    return Report(out, arch, quantization, dtype_name, notices)


def _publish(
    out: Path,
    config: dict[str, Any],
    tokenizer: dict[str, Any],
    tokenizer_config: dict[str, Any],
    weights: dict[str, mx.array],
    source: dict[str, Any],
) -> None:
    """Write the folder under a temporary name beside ``out`` and rename it into place. Another
    process that published the same folder first wins: its copy is kept, this one removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would make the model private to this user
        _write_weights(tmp, weights)
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
