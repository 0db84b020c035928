"""A dequantized copy of the batched projections' weights (``serve --dense-shadow``).

At large row counts a plain matrix product on the activation dtype can beat the backend's quantized
matmul (on MLX CUDA the dense product runs on cuBLAS's tensor-core kernels). With the shadow on,
every 4- or 8-bit affine ``QuantizedLinear`` the batched path routes (``fastpath._projections``) gets
its weight dequantized once, at load, to the dtype of its scales (the model's activations), kept
outside the module's parameters (so fingerprints, checkpoints and the weights the benchmarks count
are the quantized model's). Calibration times the shadow as one more way (``fastpath.DENSE``) from
``MIN_ROWS`` rows, so it runs only at the shapes and row counts where it measured cheaper; only the
``wide`` level routes by plans, so the exact levels (bursts' verify) never reach it.

It costs memory: about four (4-bit) or two (8-bit) times those weights again. ``on`` makes it
whatever the device holds; ``auto`` only where plans are calibrated (MLX CUDA) and the memory MLX may
use, less what is in use, leaves the KV reserve and ``MARGIN_SHARE`` of the limit free (``decide``);
``off`` (the default) never.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from workers.kernels import fastpath

log = logging.getLogger("mlx_batchd")

MODES = ("off", "auto", "on")
#: Row counts from which calibration times the shadow (below, a quantized call reads fewer bytes
#: and the dense product has too few rows to pay for reading four times as many).
MIN_ROWS = 16
#: Without a KV budget, ``auto`` keeps free the KV of this many tokens for each of ``max_batch`` sequences.
RESERVE_TOKENS = 1024
#: The share of MLX's memory limit ``auto`` also keeps free (activations, MLX's buffer cache).
MARGIN_SHARE = 0.10


@dataclass(frozen=True)
class Choice:
    """What ``configure`` did: the mode asked for, whether the shadow is made, its bytes, and why."""

    mode: str
    on: bool
    nbytes: int
    reason: str

    def line(self) -> str:
        """The banner's words for it."""
        if self.on:
            return f"on, {self.nbytes / 2**30:.2f} GiB (--dense-shadow {self.mode}: {self.reason})"
        return f"off (--dense-shadow {self.mode}: {self.reason})"


#: Module id -> (the quantized weight it was made from, its dequantized copy).
_dense: dict[int, tuple[mx.array, mx.array]] = {}
#: Model id -> ``configure``'s choice for it.
_chosen: dict[int, Choice] = {}


def eligible(m: nn.Module) -> bool:
    """Whether ``m`` gets a shadow: a plain affine 4- or 8-bit ``QuantizedLinear`` (a subclass, such as
    a sharded layer, has its own call that the batched path does not route)."""
    return (
        type(m) is nn.QuantizedLinear
        and m.bits in (4, 8)
        and getattr(m, "mode", "affine") == "affine"
        and getattr(m, "biases", None) is not None
    )


def modules(model: nn.Module) -> list[nn.QuantizedLinear]:
    """``model``'s projections that get a shadow (each module once)."""
    seen: dict[int, nn.QuantizedLinear] = {}
    for m, _ in fastpath._projections(model):
        if eligible(m):
            assert isinstance(m, nn.QuantizedLinear)
            seen.setdefault(id(m), m)
    return list(seen.values())


def _nbytes(m: nn.QuantizedLinear) -> int:
    rows, packed = m.weight.shape
    return rows * packed * (32 // m.bits) * m.scales.dtype.size


def shadow_bytes(model: nn.Module) -> int:
    """The bytes the shadow of ``model`` takes (made or not)."""
    return sum(_nbytes(m) for m in modules(model))


def _device_memory() -> tuple[int, int]:
    """(the bytes MLX may use on the default device, the bytes in use now): the smaller of the device's
    memory (``mx.device_info``, where it says) and MLX's memory limit, and MLX's active memory."""
    limit = mx.get_memory_limit()
    try:
        info = mx.device_info()
    except Exception:  # a backend without device info
        info = {}
    total = next((v for k in ("total_memory", "memory_size") if isinstance(v := info.get(k), int) and v > 0), 0)
    return (min(limit, total) if total else limit), mx.get_active_memory()


#: Where ``decide`` reads the device's memory (tests inject a figure here).
device_memory: Callable[[], tuple[int, int]] = _device_memory


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def decide(model: nn.Module, mode: str, reserve_bytes: int) -> Choice:
    """Whether ``model`` gets its shadow under ``mode``: ``auto`` only where the batched path calibrates
    plans (which alone route rows through it) and the memory free (``device_memory``) holds it,
    ``reserve_bytes`` of KV and ``MARGIN_SHARE`` of the limit."""
    if mode not in MODES:
        raise ValueError(f"--dense-shadow must be one of {', '.join(MODES)}, not {mode!r}")
    nbytes = shadow_bytes(model)
    if mode == "off":
        return Choice(mode, False, 0, "not asked for")
    if not nbytes:
        return Choice(mode, False, 0, "the model has no 4- or 8-bit affine projections")
    if mode == "on":
        return Choice(mode, True, nbytes, "asked for")
    if not fastpath.active().calibrate_rows:
        return Choice(mode, False, 0, f"the {fastpath.active().name} policy plans no row counts to route through it")
    limit, active = device_memory()
    need = nbytes + reserve_bytes + int(MARGIN_SHARE * limit)
    words = (
        f"the shadow's {_gib(nbytes)} + {_gib(reserve_bytes)} of KV + a {MARGIN_SHARE:.0%} margin "
        f"against {_gib(limit - active)} free of {_gib(limit)}"
    )
    if need > limit - active:
        return Choice(mode, False, 0, f"too little memory: {words}")
    return Choice(mode, True, nbytes, f"fits: {words}")


def configure(model: nn.Module, mode: str, reserve_bytes: int) -> Choice:
    """``decide``, then make (or drop) ``model``'s shadow to match; logs the choice in one line."""
    choice = decide(model, mode, reserve_bytes)
    if choice.on:
        build(model)
    else:
        drop(model)
    if id(model) not in _chosen:
        weakref.finalize(model, _chosen.pop, id(model), None)
    _chosen[id(model)] = choice
    log.info("dense shadow: %s", choice.line())
    return choice


def build(model: nn.Module) -> int:
    """Make every eligible projection's shadow (evaluated one at a time, so the peak is one more
    dequantized weight); returns their bytes."""
    total = 0
    for m in modules(model):
        assert m.biases is not None
        w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(m.scales.dtype)
        mx.eval(w)
        if id(m) not in _dense:
            weakref.finalize(m, _dense.pop, id(m), None)
        _dense[id(m)] = (m.weight, w)
        total += w.nbytes
    fastpath.generation += 1
    return total


def drop(model: nn.Module) -> None:
    """Remove ``model``'s shadow (its plans naming ``DENSE`` then run flattened)."""
    for m, _ in fastpath._projections(model):
        _dense.pop(id(m), None)
    fastpath.generation += 1


def weight(m: nn.Module) -> mx.array | None:
    """``m``'s shadow, or ``None`` where it has none (or its weights were replaced since)."""
    entry = _dense.get(id(m))
    if entry is None or entry[0] is not getattr(m, "weight", None):
        return None
    return entry[1]


def has(m: nn.Module) -> bool:
    return weight(m) is not None


def project(m: nn.Module, x: mx.array) -> mx.array | None:
    """``m(x)`` for flattened rows ``x`` [rows, K] through the shadow, ``x @ w.T`` (plus the bias), or
    ``None`` where ``m`` has none."""
    w = weight(m)
    if w is None or x.ndim != 2:
        return None
    xs = x if x.dtype == w.dtype else x.astype(w.dtype)
    y = mx.addmm(m.bias, xs, w.T) if "bias" in m else xs @ w.T
    return y if y.dtype == x.dtype else y.astype(x.dtype)


def resident_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s shadow held now (0 when off). Read with every stats snapshot: with no
    shadow anywhere it answers without walking the model's modules."""
    if not _dense:
        return 0
    return sum(w.nbytes for m in modules(model) if (w := weight(m)) is not None)


def chosen(model: nn.Module) -> Choice | None:
    """``configure``'s choice for ``model`` (``None`` before it ran)."""
    return _chosen.get(id(model))
