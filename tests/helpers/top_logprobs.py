"""The top-logprobs yardstick: mlx-lm's own ``generate_step`` rows, sorted in numpy (most likely
first, ties by lower token id), and the prompt the tiny model continues in loops."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from tests.reference import reference_steps
from workers.kernels.arrays import as_float

Top = list[tuple[int, float]]
#: A prompt the tiny model continues in loops, so a prompt-lookup drafter's drafts are accepted.
LOOPING = [7, 7, 7, 7, 8, 8, 8, 8]


def canonical_top(row: mx.array, k: int) -> Top:
    """The ``k`` most likely tokens of one row, sorted in numpy: by logprob, then by token id."""
    values = np.array(row.astype(mx.float32))
    order = np.lexsort((np.arange(values.size), -values))[:k]
    return [(int(i), float(values[i])) for i in order]


def reference(path: Path, prompt: list[int], n: int, k: int) -> tuple[list[int], list[float], list[Top]]:
    """Tokens, their logprobs and their top-k from ``generate_step`` alone, stopping at EOS."""
    steps = list(reference_steps(path, prompt, n))
    return [t for t, _ in steps], [as_float(row[t]) for t, row in steps], [canonical_top(row, k) for _, row in steps]
