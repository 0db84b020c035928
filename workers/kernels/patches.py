"""Patching MLX and mlx-lm: the projection and attention entry points every pinned forward goes through.

``install`` wraps each projection method mlx-lm models use (``projections.pinnable``) and every
loaded model module's ``scaled_dot_product_attention`` (``attention.per_query_sdpa``), once; at
``wide`` the wrappers call straight through. It also replaces the batches' ``filter`` with one that
costs one host round trip per finishing step instead of one per layer (``batch_filter``), and has a
one-row batch decode without a mask, as the sequence's own cache does (``lone_mask``), and lets the
decoder layers that ``compiled_layers`` registered run compiled. ``stock`` takes them all off for a
block (the raw peer in benchmarks).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.nn as nn

from workers.kernels import compiled_layers, mlxlm
from workers.kernels.attention import per_query_sdpa
from workers.kernels.batch_filter import filtered
from workers.kernels.lone_mask import lone_make_mask
from workers.kernels.projections import pinnable

_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Patch the projection classes and every loaded mlx-lm model module's attention entry point.

    Idempotent. Model modules imported later are patched by calling ``install`` again (model
    loading does), since each module holds its own reference to ``scaled_dot_product_attention``.
    """
    global _installed
    with _install_lock:
        if not _installed:
            for cls, method in _projection_classes():
                setattr(cls, method, pinnable(getattr(cls, method)))
            for cls in mlxlm.batch_classes():
                cls.filter = filtered(cls.filter)  # type: ignore[attr-defined]
            batch_cache = _batch_cache_class()
            batch_cache.make_mask = lone_make_mask(batch_cache.make_mask)  # type: ignore[attr-defined]
            _installed = True
        for name, module in list(sys.modules.items()):
            if not name.startswith("mlx_lm.models.") or module is None:
                continue
            fn = getattr(module, "scaled_dot_product_attention", None)
            if callable(fn) and not hasattr(fn, "__wrapped__"):
                module.scaled_dot_product_attention = per_query_sdpa(fn)  # type: ignore[attr-defined]


@contextmanager
def stock() -> Iterator[None]:
    """Run the block on unpatched MLX and mlx-lm (the raw peer in benchmarks), then patch again."""
    global _installed
    with _install_lock:
        was = _installed
        if was:
            for cls, method in _projection_classes():
                setattr(cls, method, getattr(cls, method).__wrapped__)
            for cls in mlxlm.batch_classes():
                cls.filter = cls.filter.__wrapped__  # type: ignore[attr-defined]
            batch_cache = _batch_cache_class()
            batch_cache.make_mask = batch_cache.make_mask.__wrapped__  # type: ignore[attr-defined]
            _installed = False
        compiled, compiled_layers.enabled = compiled_layers.enabled, False
        patched = {}
        for name, module in list(sys.modules.items()):
            fn = getattr(module, "scaled_dot_product_attention", None) if name.startswith("mlx_lm.models.") else None
            if fn is not None and hasattr(fn, "__wrapped__"):
                patched[name] = fn
                module.scaled_dot_product_attention = fn.__wrapped__  # type: ignore[attr-defined]
    try:
        yield
    finally:
        with _install_lock:
            for name, fn in patched.items():
                sys.modules[name].scaled_dot_product_attention = fn  # type: ignore[attr-defined]
            compiled_layers.enabled = compiled
        if was:
            install()


def _batch_cache_class() -> type:
    from mlx_lm.models.cache import BatchKVCache

    return BatchKVCache


def _projection_classes() -> list[tuple[type, str]]:
    """(class, method) pairs that compute every projection mlx-lm models use."""
    from mlx_lm.models import switch_layers

    return [
        (nn.Linear, "__call__"),
        (nn.QuantizedLinear, "__call__"),
        (nn.Embedding, "as_linear"),  # tied output heads
        (nn.QuantizedEmbedding, "as_linear"),
        (switch_layers.SwitchGLU, "__call__"),  # MoE experts: chunked per token, router included
        (switch_layers.SwitchMLP, "__call__"),
    ]
