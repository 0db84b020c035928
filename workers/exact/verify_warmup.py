"""The verify's kernels, built before the first burst round needs them.

Why: the project's own kernels (``mx.fast.cuda_kernel``: ``qmv_rows``, ``rowkernel``, ``sdpa_rows``)
are compiled the first time each template instance runs, and the row count is a template argument,
so a verify block of ``n`` rows at a level that runs them needs its own instances. MLX keeps custom
kernels in memory only: its on-disk cache of compiled kernels held MLX's own (quantized matmul,
gather, fused elementwise) and none of the project's, and the mirrored kernel's first call for a new
group of matrices takes seconds (compile plus the check against MLX's one-row call; CUTLASS headers).
A verdict read from the store runs no forward at all, and the probe runs blocks of ``K + 1`` rows
only, so serving's first blocks of the other lengths (prompt lookup drafts 0..K tokens a round)
compiled inside burst rounds, which then cost a hundred times a warm round, and the adaptive gate
stopped the bursts.

So before a verdict reaches the burst runner the engine runs one verify forward of every length
``2..K + 1`` at the verdict's level, or of ``K + 1`` alone for a drafter that always proposes K
tokens (an MTP head, a draft model: every block it asks for is that long, and building every length
costs tens of seconds on a fresh GPU machine); a lone token is verified at
the classic level. Plus one classic step when the level pins the chain too, on a scratch cache: one
forward (a prefill chunk, a length) per probe step, so serving waits for one forward at most. The
forwards are counted as pinned with purpose ``warm``.
On the CPU nothing is compiled and the forwards cost a few milliseconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from workers.api import Level
from workers.exact.draws import WITHIN, MakeCache, prefill_steps
from workers.exact.pins import unpinned
from workers.kernels import scoped, stabilize_layout, wrap_caches

log = logging.getLogger("mlx_batchd.verify_warmup")

#: Purpose the warm-up's forwards are counted under (``PinLedger``).
PURPOSE = "warm"


def block_lengths(k: int, fixed: bool = False) -> list[int]:
    """The verify block lengths a burst with ``k`` drafts a round can run at its level: ``k + 1``
    alone where the drafter always proposes ``k`` (``Drafter.fixed_k``)."""
    return [k + 1] if fixed else list(range(2, k + 2))


def warm_steps(
    model: Any, make_cache: MakeCache, level: Level, lengths: list[int], prompt: list[int]
) -> Generator[str, None, list[int]]:
    """One verify forward per block length in ``lengths`` at ``level`` on a cache prefilled with
    ``prompt``, a forward per step (the prefill's chunks first, labelled ``verify warm-up at LEVEL /
    prefill i/n``; then a length per step); returns the lengths run. The cache is trimmed back after
    each block, so every block sees the same short context. Each pin is entered and left within its
    step."""
    tic = time.perf_counter()
    cache = make_cache()
    stabilize_layout(cache)  # as a burst's caches grow
    yield from prefill_steps(model, cache, prompt, f"verify warm-up at {level.value}{WITHIN.rstrip()}")
    for n in lengths:
        tokens = [prompt[i % len(prompt)] for i in range(n)]
        with unpinned(PURPOSE), scoped(level):
            mx.eval(model(mx.array([tokens]), cache=wrap_caches(cache) if level.per_query else cache))
        trim_prompt_cache(cache, n)
        yield f"warm-up: verify of {n} rows at {level.value}"
    if level.pins_chain:
        with unpinned(PURPOSE), scoped(level):
            mx.eval(model(mx.array([prompt[:1]]), cache=cache))
        yield f"warm-up: classic step at {level.value}"
    log.info(
        "verify at %s: blocks of %s rows built in %.2f s before the first burst",
        level.value,
        ", ".join(map(str, lengths)),
        time.perf_counter() - tic,
    )
    return lengths
