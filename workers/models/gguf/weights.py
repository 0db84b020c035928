"""A GGUF file's tensors as mlx-lm parameters: quantized ones carried over bit for bit.

``mx.load`` hands Q4_0, Q4_1 and Q8_0 tensors back as MLX affine quantization with group size 32:
the packed ``uint32`` weight plus ``.scales`` and ``.biases`` (float16, as the file stores its block
scales; Q4_0's and Q8_0's bias is ``-8 * d`` and ``-128 * d``, exact in float16). Those integers are
kept as they are; only the scales' and biases' dtype is chosen for the backend (``scales_dtype``),
which is exact since float16 widens to float32 without rounding. F16 and F32 matrices stay as they
are, BF16 ones are read from the file's own bytes (MLX would hand them back as float16). Q4_K and
Q6_K, which MLX cannot keep packed, are decoded from the file's bytes (``kquants``) and quantized
again to MLX affine 4 and 6 bits, group 32, and the loss that costs is measured and stated; any
other type is refused by name.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

from workers.models.gguf import kquants
from workers.models.gguf.names import SKIPPED, module_name, permuted_heads, unpermute_rows
from workers.models.gguf.reader import GGUFError, Header

#: Types kept packed, with their bit width (group size 32 for all).
CARRIED = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
#: Types MLX can only dequantize, with the width they are quantized to again.
REQUANTIZED = {"Q4_K": 4, "Q6_K": 6}
FLOATS = {"F32", "F16", "BF16"}
GROUP_SIZE = 32


def scales_dtype(device: Any = None) -> mx.Dtype:
    """float32 on the CPU backend, float16 on a GPU: MLX's CPU quantized matmul is many times
    faster with float32 scales than with half-precision ones, while a GPU reads half the bytes."""
    device = device if device is not None else mx.default_device()
    return mx.float32 if device == mx.cpu else mx.float16


def refused_types(header: Header) -> dict[str, int]:
    """Tensor types in ``header`` that are neither carried, re-quantized nor plain floats, by count."""
    known = set(CARRIED) | set(REQUANTIZED) | FLOATS
    return dict(Counter(t.type_name for t in header.tensors.values() if t.type_name not in known))


@dataclass
class Converted:
    """What the conversion made: parameters by mlx-lm name, per-module bit widths, what was done."""

    weights: dict[str, mx.array] = field(default_factory=dict)
    bits: dict[str, int] = field(default_factory=dict)  # module path -> width, quantized modules only
    requantized: Counter[str] = field(default_factory=Counter)
    error_sq: float = 0.0
    value_sq: float = 0.0

    @property
    def requant_error(self) -> float:
        """Relative RMS error of the re-quantized tensors against the file's own values."""
        return (self.error_sq / self.value_sq) ** 0.5 if self.value_sq else 0.0

    def quantization(self) -> dict[str, Any] | None:
        """mlx-lm's ``quantization`` entry: the most common width as the default, every module of
        another width named with its own (mlx-lm's ``class_predicate`` reads them by path)."""
        if not self.bits:
            return None
        default = Counter(self.bits.values()).most_common(1)[0][0]
        entry: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
        for path, bits in sorted(self.bits.items()):
            if bits != default:
                entry[path] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
        return entry


def _bf16(path: Path, offset: int, shape: tuple[int, ...]) -> mx.array:
    count = int(np.prod(shape)) if shape else 1
    raw = np.fromfile(path, dtype=np.uint16, count=count, offset=offset).reshape(shape)
    return mx.array(raw).view(mx.bfloat16)


def convert_weights(
    path: Path,
    header: Header,
    tensors: dict[str, mx.array],
    arch: str,
    heads: int,
    kv_heads: int,
    dtype: mx.Dtype,
    progress: bool = False,
) -> Converted:
    """Every tensor of the file as mlx-lm parameters. ``dtype`` is the scales' and vectors' dtype
    (``scales_dtype``); llama's Q/K rows are put back in Hugging Face's order (``names``)."""
    from tqdm import tqdm

    out = Converted()
    items = tqdm(header.tensors.items(), desc="converting", unit="tensor", disable=not progress, leave=False)
    for name, info in items:
        if name in SKIPPED:
            continue
        module, param = module_name(name, arch)
        kind = info.type_name
        stem = name.rsplit(".", 1)[0]
        parts: dict[str, mx.array]
        if kind in CARRIED:
            w = tensors[name]
            scales, biases = tensors.get(f"{stem}.scales"), tensors.get(f"{stem}.biases")
            bits = CARRIED[kind]
            if w.dtype != mx.uint32 or scales is None or biases is None:
                raise GGUFError(f"tensor {name!r} ({kind}) did not come back from MLX quantized")
            if w.shape[-1] * 32 // bits != info.shape[-1] or scales.shape[-1] * GROUP_SIZE != info.shape[-1]:
                raise GGUFError(f"tensor {name!r} ({kind}) came back from MLX in an unexpected layout")
            parts = {"weight": w, "scales": scales.astype(dtype), "biases": biases.astype(dtype)}
            out.bits[module] = bits
        elif kind in REQUANTIZED:
            values = mx.array(kquants.dequantize(path, info.offset, info.nbytes, info.shape, kind))
            bits = REQUANTIZED[kind]
            w, scales, biases = mx.quantize(values, group_size=GROUP_SIZE, bits=bits)
            back = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=bits)
            out.error_sq += cast(float, mx.sum(mx.square(back - values)).item())
            out.value_sq += cast(float, mx.sum(mx.square(values)).item())
            parts = {"weight": w, "scales": scales.astype(dtype), "biases": biases.astype(dtype)}
            out.bits[module] = bits
            out.requantized[kind] += 1
        elif kind in FLOATS:
            value = _bf16(path, info.offset, info.shape) if kind == "BF16" else tensors[name]
            if value.ndim == 1:  # norms and biases: llama.cpp keeps them F32 whatever the model's dtype
                value = value.astype(dtype)
            parts = {param: value}
        else:
            raise GGUFError(f"tensor {name!r} is {kind}, which this converter does not take")
        group = permuted_heads(name, arch, heads, kv_heads)
        for key, value in parts.items():
            if group is not None:
                value = unpermute_rows(value, group)
            out.weights[f"{module}.{key}"] = value
        mx.eval(list(parts.values()))
    return out
