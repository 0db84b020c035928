"""Width measurement and calibration: the widest row count each projection computes exactly.

A projection's width is the widest M whose M-row call is byte-equal to M one-row calls. It is
measured once at load on random rows (``measure_widths``), per distinct projection signature, and
then verified by the probe on the rows a real block feeds each module (``calibrate``), narrowing
it where it does not hold. Both write the width table (``widths``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from workers.api import Level
from workers.kernels import qmv_rows
from workers.kernels.byte_equal import bytes_equal, bytes_view
from workers.kernels.levels import scoped
from workers.kernels.patches import install
from workers.kernels.projections import CapturedCall, chunked
from workers.kernels.widths import MAX_MEASURED_WIDTH, chunk_widths, load_time_widths, track_measured


@dataclass
class WidthReport:
    """Row-exact widths found for each distinct projection signature of a model."""

    widths: dict[str, int] = field(default_factory=dict)
    #: Read from the width store, not measured in this process.
    stored: bool = False
    #: Not measured: no forward of this process runs above ``wide``, where the widths are read.
    skipped: bool = False

    def narrowest(self) -> int:
        return min(self.widths.values(), default=1)


Probe = Callable[[mx.array, slice], mx.array]


def _signature_and_probe(module: nn.Module, max_width: int) -> tuple[str, Probe, int, mx.Dtype] | None:
    """A key shared by modules that compute identically, a call on a slice of input rows, and the
    input width. MoE experts get a fixed routing table so every slice routes its rows the same."""
    from mlx_lm.models import switch_layers

    if isinstance(module, nn.QuantizedLinear):
        d_in = module.weight.shape[-1] * 32 // module.bits
        sig = f"QuantizedLinear{tuple(module.weight.shape)}/{module.bits}b{module.group_size}/{module.scales.dtype}"
        return sig, lambda x, rows: module(x[rows]), d_in, module.scales.dtype
    if isinstance(module, nn.Linear):
        sig = f"Linear{tuple(module.weight.shape)}/{module.weight.dtype}"
        return sig, lambda x, rows: module(x[rows]), module.weight.shape[1], module.weight.dtype
    if isinstance(module, nn.QuantizedEmbedding):
        d_in = module.weight.shape[-1] * 32 // module.bits
        sig = f"QuantizedEmbedding.as_linear{tuple(module.weight.shape)}/{module.bits}b/{module.scales.dtype}"
        return sig, lambda x, rows: module.as_linear(x[rows]), d_in, module.scales.dtype
    if isinstance(module, nn.Embedding):
        sig = f"Embedding.as_linear{tuple(module.weight.shape)}/{module.weight.dtype}"
        return sig, lambda x, rows: module.as_linear(x[rows]), module.weight.shape[1], module.weight.dtype
    if isinstance(module, switch_layers.SwitchGLU | switch_layers.SwitchMLP):
        first = module.gate_proj if isinstance(module, switch_layers.SwitchGLU) else module.fc1
        bits = getattr(first, "bits", None)
        d_in = first.weight.shape[-1] * (32 // bits if bits else 1)
        dtype = first.scales.dtype if bits else first.weight.dtype
        table = mx.random.randint(0, first.weight.shape[0], (max_width, 2), key=mx.random.key(1))
        sig = f"{type(module).__name__}{tuple(first.weight.shape)}/{dtype}"
        return sig, lambda x, rows: module(x[rows], table[rows]), d_in, dtype
    return None


class WidthLookup(Protocol):
    """Widths measured by an earlier process (``workers.models.width_store``)."""

    def get(self, signatures: list[str], max_width: int, seed: int) -> dict[str, int] | None: ...

    def put(self, widths: dict[str, int]) -> None: ...


def measure_widths(
    model: nn.Module,
    max_width: int = MAX_MEASURED_WIDTH,
    seed: int = 0,
    stored: WidthLookup | None = None,
    measure: bool = True,
) -> WidthReport:
    """Find, for each projection signature, the widest M whose M-row call is byte-equal to M
    single-row calls for every M up to it (W = 1 when M = 2 already differs), and register the
    width for every module with that signature. Runs at wide, outside any pin. With ``stored``, widths
    it holds for exactly these signatures are registered without a forward, and measured ones kept there.
    Without ``measure`` it only installs the projections' patches and sibling groups: a module with no
    width runs one row a call above ``wide``, and on MLX CUDA the measurement's first compiles would
    delay ``Ready`` for forwards that never come."""
    install()
    qmv_rows.register_siblings(model)
    if not measure:
        return WidthReport(skipped=True)
    by_sig: dict[str, list[int]] = {}
    probes: dict[str, tuple[Probe, int, mx.Dtype]] = {}
    for _, module in model.named_modules():
        found = _signature_and_probe(module, max_width)
        if found is None:
            continue
        sig, call, d_in, dtype = found
        by_sig.setdefault(sig, []).append(id(module))
        probes.setdefault(sig, (call, d_in, dtype))
    known = None if stored is None else stored.get(list(probes), max_width, seed)
    report = WidthReport(known or _measured(probes, max_width, seed), stored=known is not None)
    for sig, width in report.widths.items():
        for mid in by_sig[sig]:
            chunk_widths[mid] = load_time_widths[mid] = width
    track_measured(model)
    if stored is not None and known is None:
        stored.put(report.widths)
    return report


def _measured(probes: dict[str, tuple[Probe, int, mx.Dtype]], max_width: int, seed: int) -> dict[str, int]:
    """Each signature's width, measured on ``max_width`` random rows at wide."""
    widths: dict[str, int] = {}
    with scoped(Level.WIDE):
        for sig, (call, d_in, dtype) in probes.items():
            x = (mx.random.normal((max_width, d_in), key=mx.random.key(seed)) * 0.5).astype(dtype)
            singles = mx.concatenate([call(x, slice(i, i + 1)) for i in range(max_width)], axis=0)
            width = 1
            for m in range(2, max_width + 1):
                if not bytes_equal(call(x, slice(0, m)), singles[:m]):
                    break
                width = m
            widths[sig] = width
    return widths


def calibrate(calls: list[CapturedCall]) -> dict[int, tuple[int, int]]:
    """Check each captured call's width on the rows it was actually given, and narrow it where it
    does not hold: the widest ``w`` no wider than the module's width (and its row count) whose
    chunked calls are byte-equal to one-row calls in decode's shape on those rows (``W = 1`` when
    none is). Returns ``{module id: (width before, width after)}`` for every module narrowed.

    A width measured at load holds on the random rows it was measured on; whether a kernel's
    multi-row call reduces like its one-row call can depend on the data, so the probe verifies each
    width on the rows of the draw it is used for."""
    todo = [c for c in calls if chunk_widths.get(id(c.module), 1) > 1 and c.rows.shape[0] > 1]

    def outputs(c: CapturedCall, width: int) -> mx.array:
        return chunked(c.module, c.original, width, c.rows, c.extra, c.kwargs, c.lead_rank)

    singles = [outputs(c, 1) for c in todo]
    tops = [min(chunk_widths.get(id(c.module), 1), c.rows.shape[0]) for c in todo]
    holds = _all_bytes_equal([(outputs(c, top), one) for c, top, one in zip(todo, tops, singles, strict=True)])
    narrowed: dict[int, tuple[int, int]] = {}
    for c, top, one, ok in zip(todo, tops, singles, holds, strict=True):
        if ok:
            continue
        width = next((w for w in range(top - 1, 1, -1) if bytes_equal(outputs(c, w), one)), 1)
        mid = id(c.module)
        before = narrowed.get(mid, (chunk_widths[mid], width))[0]
        chunk_widths[mid] = min(chunk_widths[mid], width)
        narrowed[mid] = (before, chunk_widths[mid])
    return narrowed


def _all_bytes_equal(pairs: list[tuple[mx.array, mx.array]]) -> list[bool]:
    """``bytes_equal`` for many pairs, read back from the device once."""
    flags = [
        mx.all(bytes_view(a) == bytes_view(b)) if a.shape == b.shape and a.dtype == b.dtype else mx.array(False)
        for a, b in pairs
    ]
    return [bool(f) for f in mx.stack(flags).tolist()] if flags else []  # type: ignore[union-attr]
