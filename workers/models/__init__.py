"""The models room: loading a model and its tokenizer (``loading``), the embedded demo models (``demo``),
GGUF conversion (``gguf``), synthetic models for tests and benchmarks (``synthetic``) and the MTP
head (``mtp``); measured projection widths kept per model (``width_store``)."""

from __future__ import annotations

from workers.models.demo import (
    SHIPPED,
    cache_dir,
    demo_path,
)
from workers.models.loading import (
    LoadedModel,
    ModelError,
    check_model,
    check_sharding,
    load,
    load_tokenizer,
    read_config,
    resolve_model_path,
)
from workers.models.mtp import (
    load_mtp,
    target_forward,
)
from workers.models.width_store import model_files

__all__ = [
    "LoadedModel",
    "ModelError",
    "SHIPPED",
    "cache_dir",
    "check_model",
    "check_sharding",
    "demo_path",
    "load",
    "load_mtp",
    "load_tokenizer",
    "model_files",
    "read_config",
    "resolve_model_path",
    "target_forward",
]
