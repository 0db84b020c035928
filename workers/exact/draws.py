"""The probe's draws and how one is run: classic decode's chain and the verify block, compared byte for byte.

Draws are chosen where divergences hide: short prompts, a block whose keys run 255 -> 256 -> 257
(mlx-lm's capacity step, where kernels have shown key-length effects), and a long context past the
sliding window (or >= 1024 tokens). Every run starts from a fresh cache built as serving builds it,
with a layout-stable growth step (``layout_stable``), as bursts get.

Each run is also a step generator of one forward a unit (``chain_steps``, ``block_steps``,
``calibrated_block_steps``; a prefill chunk, one decode step, one block), each forward evaluated
before its unit yields and any level or capture entered and left within that unit: the engine
serves between the units at its own level, and a request waits for one forward, not a draw. The
plain calls (``run_chain``, ``run_block``) drive them to the end: the same forwards in the same order.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator
from contextlib import nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from workers.api import Level
from workers.kernels import (
    CapturedCall,
    as_int,
    calibrate,
    capturing,
    drive,
    mlxlm,
    scoped,
    stabilize_layout,
    wrap_caches,
)

#: In the label of a unit inside a draw (``head / what``); a draw's own label has none, so logs and
#: progress bars count draws by it (``within_draw``).
WITHIN = " / "
SHORT_PROMPT = 8
CAPACITY_STEP = 256
LONG_CONTEXT = 1024
#: Block runs per draw at most while calibration still narrows widths (they only ever narrow).
MAX_CALIBRATION_PASSES = 4


@dataclass(frozen=True)
class Draw:
    """One probe input: prefill ``prompt[:-1]``, then chain/block from ``prompt[-1]``."""

    name: str
    prompt: list[int]


def within_draw(label: str) -> bool:
    """Whether a probe unit's ``label`` is a forward inside a draw rather than a draw's own label."""
    return WITHIN in label


def sliding_window(config: dict[str, Any]) -> int | None:
    for source in (config, config.get("text_config") or {}):
        w = source.get("sliding_window")
        if isinstance(w, int) and w > 0:
            return w
    return None


def make_draws(k: int, vocab: int, context: int, window: int | None, seed: int = 0) -> list[Draw]:
    """Three short draws, one whose block crosses a capacity boundary, one long one."""
    rng = random.Random(seed)
    width = k + 1

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    draws = [Draw(f"short-{i + 1}", prompt(SHORT_PROMPT)) for i in range(3)]
    # Keys before the block: ``o``; query j sees o + j + 1 keys. Start so they run 255, 256, 257.
    o = CAPACITY_STEP - 2 if width >= 3 else CAPACITY_STEP - 1
    if o + width < context:
        draws.append(Draw(f"capacity-{CAPACITY_STEP}", prompt(o + 1)))
    long_len = max(window + 64, LONG_CONTEXT + 37) if window is not None else LONG_CONTEXT + 37
    long_len = min(long_len, context - width - 1)
    if long_len > o + 1:
        draws.append(Draw(f"long-{long_len}" + (f"-past-window-{window}" if window else ""), prompt(long_len)))
    return draws


MakeCache = Callable[[], list[Any]]
#: A step generator: one unit per ``next``, each yielding a label of what it did, ending in a value.
Steps = Generator[str, None, Any]
#: Tokens per prefill forward (a chunk) at most.
PREFILL_STEP = 2048
#: Tokens per prefill forward of the start-up work running now (``paced``).
_CHUNK: ContextVar[int] = ContextVar("prefill_chunk", default=PREFILL_STEP)


def prefill_chunk() -> int:
    """Tokens per prefill forward here: ``PREFILL_STEP``, or less inside ``paced`` work."""
    return _CHUNK.get()


def paced(steps: Steps, chunk: Callable[[], int]) -> Steps:
    """``steps`` with every prefill forward in them (``prefill_chunk``) of at most ``chunk()`` tokens
    (within ``PREFILL_STEP``), read when its first unit runs: an engine sizes it from its prefill
    pace (``Holdings.paced``), so that a start-up unit is one short forward. One size for the whole
    run, so every draw of a probe prefills its prompt alike."""
    size = 0
    while True:
        size = size or max(1, min(PREFILL_STEP, chunk()))
        token = _CHUNK.set(size)
        try:
            label = next(steps)
        except StopIteration as end:
            return end.value
        finally:
            _CHUNK.reset(token)
        yield label


def prefill(model: Any, cache: list[Any], tokens: list[int], step: int | None = None) -> None:
    drive(prefill_steps(model, cache, tokens, "prefill", step))


def prefill_steps(
    model: Any, cache: list[Any], tokens: list[int], what: str, step: int | None = None
) -> Generator[str, None, None]:
    """``prefill`` a chunk per unit (``step`` tokens, default ``prefill_chunk()``), each chunk's cache
    evaluated before its yield."""
    step = step or prefill_chunk()
    count = -(-len(tokens) // step)
    for n, i in enumerate(range(0, len(tokens), step), 1):
        model(mx.array([tokens[i : i + step]]), cache=cache)
        mx.eval([c.state for c in cache])
        yield f"{what} prefill {n}/{count}"


def timed(steps: Generator[str, None, Any], busy: list[float]) -> Generator[str, None, Any]:
    """``steps`` unchanged, adding the seconds its own units take (not the time between them, when
    the engine serves) to ``busy[0]``."""
    while True:
        tic = time.perf_counter()
        try:
            label = next(steps)
        except StopIteration as end:
            busy[0] += time.perf_counter() - tic
            return end.value
        busy[0] += time.perf_counter() - tic
        yield label


def chain_level(level: Level) -> Level:
    """The level classic decode runs at while ``level`` is the verdict: wide, except for a rung
    that pins the chain too (``padded``)."""
    return level if level.pins_chain else Level.WIDE


def run_chain(
    model: Any, make_cache: MakeCache, draw: Draw, width: int, level: Level = Level.WIDE
) -> tuple[mx.array, list[int]]:
    """Classic decode as the engine runs a lone sequence's: ``width`` single-token forwards at
    ``level``, feeding its own argmax, on the prefilled cache merged into a one-row batch (mlx-lm's
    ``BatchGenerator`` decodes on such a cache, whose attention MLX may compute with other bytes
    than the single-sequence cache's: ``workers.kernels.lone_mask``). A verdict is then about the tokens
    the engine serves, not about a decode that it never runs."""
    result: tuple[mx.array, list[int]] = drive(chain_steps(model, make_cache, draw, width, level))
    return result


def chain_steps(
    model: Any, make_cache: MakeCache, draw: Draw, width: int, level: Level = Level.WIDE, what: str = "chain"
) -> Generator[str, None, tuple[mx.array, list[int]]]:
    """``run_chain`` a forward per unit (a prefill chunk, one decode step), each evaluated before its
    yield; the level is entered and left within each decode step's unit, so whatever runs between
    the units runs at its own."""
    single = make_cache()
    yield from prefill_steps(model, single, draw.prompt[:-1], what)
    cache = mlxlm.merge_caches([single])
    token = draw.prompt[-1]
    fed, rows = [], []
    for i in range(width):
        fed.append(token)
        with scoped(level):
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
            mx.eval(logits)
            rows.append(logits)
            token = as_int(mx.argmax(logits))
        yield f"{what} decode {i + 1}/{width}"
    return mx.stack(rows), fed


def run_block(
    model: Any,
    make_cache: MakeCache,
    draw: Draw,
    tokens: list[int],
    level: Level,
    calls: list[CapturedCall] | None = None,
) -> mx.array:
    """One forward over ``tokens`` at ``level`` on a freshly prefilled cache; with ``calls``, the
    block's own projection calls (never the prefill's) are captured into it for calibration."""
    block: mx.array = drive(block_steps(model, make_cache, draw, tokens, level, calls))
    return block


def block_steps(
    model: Any,
    make_cache: MakeCache,
    draw: Draw,
    tokens: list[int],
    level: Level,
    calls: list[CapturedCall] | None = None,
    what: str = "block",
) -> Generator[str, None, mx.array]:
    """``run_block`` a forward per unit (each prefill chunk, then the block), each evaluated before
    its yield; the level and the capture are entered and left within the block's unit."""
    cache = make_cache()
    yield from prefill_steps(model, cache, draw.prompt[:-1], what)
    with scoped(level), capturing(calls) if calls is not None else nullcontext():
        layers = wrap_caches(cache) if level.per_query else cache
        logits = model(mx.array([tokens]), cache=layers)[0]
        mx.eval(logits)
    yield f"{what} forward"
    return logits


def run_calibrated_block(
    model: Any, make_cache: MakeCache, draw: Draw, tokens: list[int], level: Level
) -> tuple[mx.array, dict[int, tuple[int, int]]]:
    """``run_block`` at a calibrated level, with every width verified on the rows this block feeds
    its module: where one does not hold it is narrowed and the block run again (narrower widths
    change the activations downstream, so until a run narrows nothing). Returns the block's logits
    and ``{module id: (width before, width after)}`` for the modules narrowed."""
    result: tuple[mx.array, dict[int, tuple[int, int]]] = drive(
        calibrated_block_steps(model, make_cache, draw, tokens, level)
    )
    return result


def calibrated_block_steps(
    model: Any, make_cache: MakeCache, draw: Draw, tokens: list[int], level: Level, what: str = "block"
) -> Generator[str, None, tuple[mx.array, dict[int, tuple[int, int]]]]:
    """``run_calibrated_block`` a forward per unit (``block_steps`` per pass; a pass's calibration
    runs in the unit after its block's)."""
    narrowed: dict[int, tuple[int, int]] = {}
    for n in range(MAX_CALIBRATION_PASSES):
        calls: list[CapturedCall] = []
        block = yield from block_steps(model, make_cache, draw, tokens, level, calls, f"{what} pass {n + 1}")
        changed = calibrate(calls)
        if not changed:
            return block, narrowed
        for mid, (before, after) in changed.items():
            narrowed[mid] = (narrowed.get(mid, (before, after))[0], after)
    block = yield from block_steps(model, make_cache, draw, tokens, level, what=f"{what} after calibration")
    return block, narrowed


def layout_stable(make_cache: MakeCache) -> MakeCache:
    """``make_cache`` whose caches grow in ``LAYOUT_STEP`` tokens, as a burst's caches do."""

    def make() -> list[Any]:
        cache = make_cache()
        stabilize_layout(cache)
        return cache

    return make


def compare(chain: mx.array, block: mx.array) -> tuple[int | None, int, int]:
    """First differing position, differing bytes, total bytes."""
    a = chain.view(mx.uint8).reshape(chain.shape[0], -1)
    b = block.view(mx.uint8).reshape(block.shape[0], -1)
    diff = a != b
    per_row: list[int] = mx.sum(diff, axis=1).tolist()  # type: ignore[assignment]
    first = next((i for i, n in enumerate(per_row) if n), None)
    return first, int(sum(per_row)), int(a.size)
