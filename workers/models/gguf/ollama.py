"""``ollama:NAME[:TAG]``: the GGUF file Ollama keeps for a model it pulled, found in its local store.

Ollama's store (``~/.ollama/models``, or ``$OLLAMA_MODELS``) holds one manifest a model and tag,
``manifests/registry.ollama.ai/library/NAME/TAG`` (``NAMESPACE/NAME`` for a user's model), whose
layer of media type ``application/vnd.ollama.image.model`` names the weights' blob by its SHA-256:
``blobs/sha256-<hex>``, a plain GGUF file. Nothing is downloaded: a model not pulled is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from workers.models.gguf.reader import GGUFError

PREFIX = "ollama:"
_REGISTRY = "registry.ollama.ai"
_MODEL_LAYER = "application/vnd.ollama.image.model"


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def resolve_ollama(spec: str) -> tuple[Path, str]:
    """The blob of ``ollama:NAME[:TAG]`` (tag ``latest`` by default) and its SHA-256, or a
    ``GGUFError`` saying what is missing and how to get it."""
    ref = spec.removeprefix(PREFIX)
    name, _, tag = ref.partition(":")
    tag = tag or "latest"
    if not name or "/" in tag or ".." in name.split("/"):
        raise GGUFError(f"{spec!r} is not an Ollama model name; write ollama:NAME or ollama:NAME:TAG")
    root = ollama_root()
    parts = name.split("/")
    repo = [_REGISTRY, "library", *parts] if len(parts) == 1 else ([_REGISTRY, *parts] if len(parts) == 2 else parts)
    manifest = root.joinpath("manifests", *repo, tag)
    if not manifest.is_file():
        raise GGUFError(
            f"{spec}: not in Ollama's store ({manifest} does not exist); `ollama pull {name}:{tag}` it first, "
            "or set OLLAMA_MODELS to the store's folder"
        )
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == _MODEL_LAYER)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise GGUFError(f"{spec}: the manifest {manifest} names no model layer") from None
    algo, _, hexdigest = str(digest).partition(":")
    blob = root / "blobs" / f"{algo}-{hexdigest}"
    if not blob.is_file():
        raise GGUFError(
            f"{spec}: the model's blob {blob} is missing from Ollama's store; `ollama pull {name}:{tag}` again"
        )
    return blob, hexdigest if algo == "sha256" and len(hexdigest) == 64 else ""
