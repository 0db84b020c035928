"""Localizing a divergence: the first sublayer, in forward order, whose output differs between chain and block.

Run only when the policy asks for it (``ProbePolicy.localize``): every decoder layer and its
attention and MLP sublayers are wrapped to record their outputs, the chain and the block are run
again, and the recorded outputs are compared position by position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from workers.api import Level
from workers.exact.draws import Draw, MakeCache, chain_level, prefill
from workers.kernels import bytes_equal, scoped, wrap_caches


class _Capture(nn.Module):
    """Records a sublayer's outputs, for finding the first layer/op where block and chain part."""

    def __init__(self, inner: nn.Module, name: str, store: dict[str, list[mx.array]]) -> None:
        super().__init__()
        self.inner = inner
        self._name = name
        self._store = store

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        self._store.setdefault(self._name, []).append(out)
        return out

    def __getattr__(self, key: str) -> Any:
        # Models read attributes of their layers (e.g. llama's ``use_sliding`` in make_cache).
        if key in self:
            return self[key]
        inner = dict.get(self, "inner")
        if inner is None:
            raise AttributeError(key)
        return getattr(inner, key)


def _layers(model: nn.Module) -> list[nn.Module]:
    for holder in (model, getattr(model, "model", None), getattr(model, "language_model", None)):
        layers = getattr(holder, "layers", None) if holder is not None else None
        if isinstance(layers, list):
            return layers
    return []


@dataclass
class _Hooks:
    store: dict[str, list[mx.array]]
    order: list[str]


def _install_captures(model: nn.Module) -> tuple[_Hooks, Callable[[], None]]:
    store: dict[str, list[mx.array]] = {}
    order: list[str] = []
    undo: list[Callable[[], None]] = []
    layers = _layers(model)
    for i, layer in enumerate(layers):
        for sub in ("self_attn", "mlp", "block_sparse_moe", "feed_forward"):
            inner = getattr(layer, sub, None)
            if isinstance(inner, nn.Module):
                name = f"layer {i} {sub}"
                setattr(layer, sub, _Capture(inner, name, store))
                order.append(name)
                undo.append(partial(setattr, layer, sub, inner))
        name = f"layer {i} output"
        layers[i] = _Capture(layer, name, store)
        order.append(name)
        undo.append(partial(layers.__setitem__, i, layer))

    def restore() -> None:
        for fn in reversed(undo):
            fn()

    return _Hooks(store, order), restore


def localize(
    model: nn.Module, make_cache: MakeCache, draw: Draw, tokens: list[int], level: Level, position: int
) -> str:
    """Name the first sublayer (in forward order) whose output at ``position`` differs."""
    hooks, restore = _install_captures(model)
    try:
        cache = make_cache()
        prefill(model, cache, draw.prompt[:-1])
        hooks.store.clear()
        with scoped(chain_level(level)):
            for t in tokens:
                model(mx.array([[t]]), cache=cache)
        chain = {k: v[:] for k, v in hooks.store.items()}
        cache = make_cache()
        prefill(model, cache, draw.prompt[:-1])
        hooks.store.clear()
        with scoped(level):
            model(mx.array([tokens]), cache=wrap_caches(cache) if level.per_query else cache)
        block = {k: v[:] for k, v in hooks.store.items()}
    finally:
        restore()
    for name in hooks.order:
        if name not in chain or name not in block:
            continue
        for j in range(position + 1):
            a, b = chain[name][j][0, -1], block[name][-1][0, j]
            if not bytes_equal(a, b):
                return f"{name}, position {j}"
    return "logits only (every captured layer output agrees)"
