"""GGUF in: llama.cpp's and Ollama's model files served as mlx-lm model folders.

``convert`` turns one file into a folder mlx-lm loads (weights carried over bit for bit where MLX
can keep them packed, ``config.json``, a tokenizer rebuilt from the metadata, the chat template);
``cached_model`` does it once per file into the cache and reuses it; ``resolve_ollama`` finds a
pulled model's file in Ollama's store. ``docs/gguf.md`` says what is taken and what is refused.
"""

from __future__ import annotations

from pathlib import Path

from workers.models.gguf.cache import cached_model, content_hash, gguf_cache_root, source_name
from workers.models.gguf.converter import SOURCE_FILE, Report, convert
from workers.models.gguf.names import FAMILIES, permute_rows, unpermute_rows
from workers.models.gguf.ollama import PREFIX as OLLAMA_PREFIX
from workers.models.gguf.ollama import ollama_root, resolve_ollama
from workers.models.gguf.reader import GGUFError, read_header
from workers.models.gguf.weights import scales_dtype


def is_gguf_file(path: Path) -> bool:
    """A file that starts with GGUF's magic (an Ollama blob has no ``.gguf`` suffix)."""
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def is_gguf_spec(spec: str) -> bool:
    """``ollama:NAME[:TAG]``, a ``*.gguf`` path, or a file that is GGUF by its first bytes."""
    if spec.startswith(OLLAMA_PREFIX) or spec.lower().endswith(".gguf"):
        return True
    path = Path(spec).expanduser()
    return path.is_file() and is_gguf_file(path)


def gguf_model_dir(spec: str, progress: bool = True) -> Path:
    """The cached mlx-lm folder for a GGUF spec, converted first if needed (``GGUFError`` if it
    cannot be)."""
    if spec.startswith(OLLAMA_PREFIX):
        blob, digest = resolve_ollama(spec)
        return cached_model(blob, digest or None, progress, label=spec.removeprefix(OLLAMA_PREFIX))
    return cached_model(Path(spec).expanduser(), None, progress)


__all__ = [
    "FAMILIES",
    "OLLAMA_PREFIX",
    "SOURCE_FILE",
    "GGUFError",
    "Report",
    "cached_model",
    "content_hash",
    "convert",
    "gguf_cache_root",
    "gguf_model_dir",
    "is_gguf_file",
    "is_gguf_spec",
    "ollama_root",
    "permute_rows",
    "read_header",
    "resolve_ollama",
    "scales_dtype",
    "source_name",
    "unpermute_rows",
]
