"""The divergence seam: the one place tests reach into the kernels' outputs.

MLX's CPU backend computes a row the same way whatever the rows around it, so the divergences the
levels exist for (a multi-row projection or a multi-query attention call that reduces differently)
never happen there. Tests inject them here instead: every patched projection and attention call
passes its output through ``apply``, which hands it to ``divergence_seam`` when one is set. Tests
set it here (``workers.kernels.seam.divergence_seam``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

SeamFn = Callable[[str, mx.array, int], mx.array]

#: TEST SEAM. When set, called as ``seam(kind, out, rows)`` on every projection output
#: (``kind="projection"``, rows = rows computed in one kernel call) and every attention output
#: (``kind="attention"``, rows = queries in one call) and its return value is used instead; while
#: it runs, ``seam_call`` says which call it is looking at (the projection module and its input
#: rows, or the attention's queries), so a test can make a divergence depend on the data, as
#: real kernels' byte differences do. Tests use it to inject the divergences that MLX's CPU
#: backend does not produce, e.g. "perturb any projection computed on more than 4 rows at once"
#: (fixed by narrow) or "perturb multi-query attention" (fixed by per-query). Never set in production.
divergence_seam: SeamFn | None = None


@dataclass(frozen=True)
class SeamCall:
    """The call ``divergence_seam`` is looking at: the projection module (``None`` for attention),
    the call's input as the kernel got it (projection rows, or attention queries), and an attention
    call's mask (MLX CUDA computes a one-token attention with an array mask in other bytes than
    without one: ``workers.kernels.lone_mask``)."""

    module: Any
    inputs: mx.array
    mask: Any = None


#: Set only while ``divergence_seam`` runs.
seam_call: SeamCall | None = None


def apply(
    kind: str, out: mx.array, rows: int, module: Any = None, inputs: mx.array | None = None, mask: Any = None
) -> mx.array:
    """``out``, or what ``divergence_seam`` makes of it when one is set."""
    global seam_call
    seam = divergence_seam
    if seam is None:
        return out
    seam_call = SeamCall(module, out if inputs is None else inputs, mask)
    try:
        return seam(kind, out, rows)
    finally:
        seam_call = None
