"""The GGUF file's header: its tensors' names, shapes, types and places, checked against the file.

MLX's ``mx.load`` reads the tensors and the metadata, but it hands K-quants and other types it cannot
keep packed back as float16 with no word of what they were, and BF16 as float16 too. This reader
walks the header (nothing but ``struct``) so the converter knows each tensor's stored type, can
refuse or re-quantize by name, and finds a truncated or corrupt file before MLX is asked to read it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO


class GGUFError(ValueError):
    """A GGUF file that cannot be served: truncated or corrupt, an architecture or tensor type the
    converter does not take, no tokenizer. The message is one line naming the problem."""


#: ggml's type ids: name, elements a block, bytes a block.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

# Metadata value types: fixed-size scalars by struct code; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_STRING = 1 << 24  # no key, token or template is 16 MiB: a larger length is a corrupt header


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header states it. ``shape`` is row-major (GGUF lists dims innermost first)."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.type_id, (f"type {self.type_id}", 0, 0))[0]


@dataclass(frozen=True)
class Header:
    version: int
    alignment: int
    tensors: dict[str, TensorInfo]
    architecture: str | None
    keys: frozenset[str]  # the metadata keys present


class _Cursor:
    """Reads little-endian values from the header, turning a short read into a ``GGUFError``."""

    def __init__(self, f: BinaryIO, name: str) -> None:
        self.f, self.name = f, name

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFError(f"{self.name}: the file ends inside its header (truncated download?)")
        return data

    def unpack(self, code: str) -> int | float | bool:
        size = struct.calcsize("<" + code)
        value: int | float | bool = struct.unpack("<" + code, self.take(size))[0]
        return value

    def string(self) -> str:
        n = int(self.unpack("Q"))
        if n > _MAX_STRING:
            raise GGUFError(f"{self.name}: corrupt header (a string of {n} bytes)")
        return self.take(n).decode("utf-8", errors="replace")

    def skip_value(self, vtype: int) -> object:
        """Read a metadata value; strings are returned (the one wanted is short), arrays skipped."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = int(self.unpack("I")), int(self.unpack("Q"))
            if item in _SCALARS:
                size = struct.calcsize("<" + _SCALARS[item])
                if count * size > _MAX_STRING * 64:
                    raise GGUFError(f"{self.name}: corrupt header (an array of {count} items)")
                self.f.seek(count * size, 1)
            elif item == _STRING:
                for _ in range(count):
                    self.f.seek(int(self.unpack("Q")), 1)
            else:
                raise GGUFError(f"{self.name}: corrupt header (array of value type {item})")
            return None
        raise GGUFError(f"{self.name}: corrupt header (value type {vtype})")


def read_header(path: Path) -> Header:
    """The header of ``path``, every tensor checked to lie inside the file with a size its type
    and shape give; a ``GGUFError`` for anything else (not GGUF, truncated, unknown tensor type)."""
    name = path.name
    size = path.stat().st_size
    with path.open("rb") as f:
        cur = _Cursor(f, name)
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{name}: not a GGUF file (no GGUF magic at its start)")
        version = int(cur.unpack("I"))
        if version not in (2, 3):
            raise GGUFError(f"{name}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = int(cur.unpack("Q")), int(cur.unpack("Q"))
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise GGUFError(f"{name}: corrupt header ({n_tensors} tensors, {n_kv} metadata keys)")
        alignment, arch, keys = 32, None, set()
        for _ in range(n_kv):
            key, vtype = cur.string(), int(cur.unpack("I"))
            keys.add(key)
            value = cur.skip_value(vtype)
            if key == "general.alignment" and isinstance(value, int):
                alignment = value
            elif key == "general.architecture" and isinstance(value, str):
                arch = value
        infos = []
        for _ in range(n_tensors):
            tname, ndim = cur.string(), int(cur.unpack("I"))
            if ndim > 8:
                raise GGUFError(f"{name}: corrupt header (tensor {tname!r} has {ndim} dimensions)")
            dims = [int(cur.unpack("Q")) for _ in range(ndim)]
            infos.append((tname, tuple(reversed(dims)), int(cur.unpack("I")), int(cur.unpack("Q"))))
        start = f.tell()
    if alignment <= 0:
        raise GGUFError(f"{name}: corrupt header (alignment {alignment})")
    data_start = -(-start // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for tname, shape, type_id, offset in infos:
        if type_id not in GGML_TYPES:
            raise GGUFError(f"{name}: tensor {tname!r} has ggml type id {type_id}, which this converter does not know")
        _, block, block_bytes = GGML_TYPES[type_id]
        count = 1
        for d in shape:
            count *= d
        if shape and shape[-1] % block:
            raise GGUFError(f"{name}: corrupt header (tensor {tname!r} rows do not fill whole blocks)")
        nbytes = count // block * block_bytes
        where = data_start + offset
        if where + nbytes > size:
            raise GGUFError(
                f"{name}: tensor {tname!r} extends past the end of the file (truncated download? "
                f"{size} bytes, {where + nbytes} needed)"
            )
        tensors[tname] = TensorInfo(tname, shape, type_id, where, nbytes)
    return Header(version, alignment, tensors, arch, frozenset(keys))
