"""GGUF files converted once into the cache and reused: ``$MLX_BATCHD_CACHE/gguf/<sha256>-<dtype>``.

The folder is keyed by the file's content hash (and the scales' dtype, which depends on the
backend), so a copy or a rename of the file finds it again and a changed file is converted anew.
Hashing a multi-gigabyte file takes a while, so the hash is remembered by the file's path, size
and modification time (``by-stat/``): every process of one daemon (the command line's check, the
engine, the front end's tokenizer) and every later start find the folder at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from workers.models.gguf.converter import convert, preflight
from workers.models.gguf.reader import GGUFError
from workers.models.gguf.weights import scales_dtype

_CHUNK = 8 << 20


def gguf_cache_root() -> Path:
    from workers.models.demo import cache_dir

    return cache_dir() / "gguf"


def file_sha256(path: Path, progress: bool = False) -> str:
    """The file's SHA-256, with a progress bar when asked (a large file takes seconds)."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with (
        path.open("rb") as f,
        tqdm(
            total=path.stat().st_size, desc="hashing", unit="B", unit_scale=True, disable=not progress, leave=False
        ) as bar,
    ):
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _stat_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:40]


def _memo(path: Path) -> Path:
    return gguf_cache_root() / "by-stat" / _stat_key(path)


def content_hash(path: Path, known: str | None = None, progress: bool = False) -> str:
    """``known`` (an Ollama blob names its own hash), else the hash remembered for this path, size
    and mtime, else the file hashed now."""
    if known is not None:
        return known
    try:
        remembered = _memo(path).read_text().strip()
        if len(remembered) == 64:
            return remembered
    except OSError:
        pass
    return file_sha256(path, progress)


def _remember(path: Path, digest: str) -> None:
    """Keep the hash for the next process (once the folder exists: a file that failed to convert
    leaves nothing behind); a cache that cannot be written costs only the memory."""
    memo = _memo(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        tmp.replace(memo)
    except OSError:
        pass


def cached_model(path: Path, known_hash: str | None = None, progress: bool = True, label: str | None = None) -> Path:
    """The converted folder of ``path`` in the cache, converting it first if it is not there yet.

    ``label``: the model's name as the user gave it, when the file's own name is not one. With
    ``progress``, a conversion says so in one line on stderr (and shows bars on a terminal); each
    notice (re-quantization loss, an unknown pre-tokenizer) is one more line. A file that cannot be
    converted is refused (``GGUFError``) before that line, from its header where it can be."""
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    bars = progress and sys.stderr.isatty()
    dtype = scales_dtype()
    digest = content_hash(path, known_hash, bars)
    target = gguf_cache_root() / f"{digest}-{str(dtype).removeprefix('mlx.core.')}"
    if not (target / "config.json").is_file():
        preflight(path)
        if progress:
            print(f"mlx-batchd: converting {path.name} into {target} (once)", file=sys.stderr, flush=True)
        source = {"sha256": digest, "path": str(path), "label": label or path.stem}
        report = convert(path, target, dtype=dtype, progress=bars, source=source)
        for notice in report.notices:
            print(f"mlx-batchd: {path.name}: {notice}", file=sys.stderr, flush=True)
    if known_hash is None:
        _remember(path, digest)
    return target


def source_name(folder: Path) -> str | None:
    """The name of the model a cached folder was converted from (the GGUF file's stem, or the
    Ollama name), for the name a daemon reports."""
    try:
        facts = json.loads((folder / "gguf_source.json").read_text())
    except (OSError, ValueError):
        return None
    label = facts.get("label") if isinstance(facts, dict) else None
    return label if isinstance(label, str) else None
