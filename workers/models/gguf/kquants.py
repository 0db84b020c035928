"""Q4_K and Q6_K blocks decoded from the file's bytes, as ggml's reference ``dequantize_row`` does.

MLX's GGUF reader hands these types back dequantized to float16, but its Q4_K decode takes the
scale and min of the high-nibble half of every 64 weights from the wrong sub-block (a third of the
values come out wrong: found against llama.cpp's ``gguf`` package). So the converter decodes both
itself, in float32, from the bytes the header points at, and quantizes the result for MLX.

Layouts (256 weights a block): Q4_K is ``d, dmin`` (float16), 12 bytes of eight 6-bit scales and
mins, then 128 bytes of 4-bit codes, 32 bytes for each pair of 32-weight sub-blocks (low nibbles
the first, high nibbles the second); a weight is ``d * scale * q - dmin * min``. Q6_K is 128 bytes
of low 4 bits, 64 bytes of high 2 bits, 16 signed 8-bit scales (one per 16 weights) and ``d``;
a weight is ``d * scale * (q - 32)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


def _blocks(path: Path, offset: int, nbytes: int, kind: str) -> np.ndarray:
    raw = np.fromfile(path, dtype=np.uint8, count=nbytes, offset=offset)
    return raw.reshape(-1, BLOCK_BYTES[kind])


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    low, mid, high = packed[:, 0], packed[:, 1], packed[:, 2]
    # Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins). Sub-blocks 4-7: four bits
    # from bytes 8-11 and the top two bits of bytes 0-3 (scales) or 4-7 (mins).
    scales = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], axis=1).astype(np.float32)
    mins = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], axis=1).astype(np.float32)
    codes = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (codes & 0x0F).reshape(n, 8, 32).astype(np.float32)
    return (d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).astype(np.float32) - 32.0
    return (d * scales)[:, :, None] * q.reshape(n, 16, 16)


def dequantize(path: Path, offset: int, nbytes: int, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """The float32 values of one Q4_K or Q6_K tensor stored at ``offset`` in ``path``."""
    blocks = _blocks(path, offset, nbytes, kind)
    values = _q4_k(blocks) if kind == "Q4_K" else _q6_k(blocks)
    return values.reshape(shape)
