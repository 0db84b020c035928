"""The exactness probe: is a verify block byte-identical to classic decode, and at what level?

For a pairing (target, drafter, K drafted tokens) the verify forward runs a block of ``K + 1``
tokens (the last accepted token and K drafts). The probe compares the **chain** (``K + 1``
single-token forwards, classic decode: wide, or the rung itself for one that pins the chain) with
the **block** (one forward at a kernel level) on fresh caches built as serving builds them, with a layout-stable growth step
(``kernels.LAYOUT_STEP``, as bursts get), byte for byte over every position's full logit row.
Draws are chosen where divergences hide: short prompts, a block whose keys run 255 -> 256 -> 257
(mlx-lm's capacity step, where kernels have shown key-length effects), and a long context past the
sliding window (or >= 1024 tokens).

Classic decode is run twice first: a draw whose chain does not reproduce is ``nondeterministic``
and is declined unless the operator accepts "no worse than classic's own variation".

The ladder tries wide, narrow, per-query, per-query-1 (``kernels.ladder()``; on MLX CUDA padded
comes right after wide); the verdict is the first exact rung, or
declined (fail closed). At narrow and per-query every draw's block is run with its projections'
inputs captured, and each width is verified on those rows (``kernels.calibrate``): a width that
does not hold is narrowed and the block run again, so the widths a verdict carries held on the
probe's own activations. When calibration has left every projection at one row, per-query is
per-query-1 and is reported as that rung. Verdicts (with their widths) are memoised by a
fingerprint of everything that can change the answer and persisted as JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from workers import kernels
from workers.arrays import as_int
from workers.kernels import LAYOUT_STEP, MAX_MEASURED_WIDTH, Level, bytes_equal, install, scoped, wrap_caches

log = logging.getLogger("mlx_batchd.probe")

#: Bump when the probe's method changes, so persisted verdicts are re-measured.
PROBE_VERSION = 3
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


@dataclass
class DrawResult:
    draw: str
    context: int
    exact: bool
    nondeterministic: bool = False
    first_position: int | None = None
    differing_bytes: int = 0
    total_bytes: int = 0
    chain_vs_chain_bytes: int = 0
    accepted_as_classic_variation: bool = False
    seconds: float = 0.0
    first_divergence: str | None = None
    #: Projections whose width this draw's calibration narrowed (the block was then run again).
    narrowed: int = 0


@dataclass
class LevelResult:
    level: str
    exact: bool
    draws: list[DrawResult] = field(default_factory=list)
    seconds: float = 0.0
    #: Calibration at this rung: module path -> [width before, width after].
    narrowed: dict[str, list[int]] = field(default_factory=dict)
    #: Why the rung was not run (its draws are then empty).
    skipped: str | None = None


@dataclass
class Verdict:
    """The outcome for one pairing. ``level is None`` means declined: bursts must not run."""

    fingerprint: str
    pairing: dict[str, Any]
    level: str | None
    exact: bool
    reason: str
    ladder: list[LevelResult]
    probe_seconds: float
    created: float = field(default_factory=time.time)
    from_cache: bool = False
    #: The ladder as configured, cheapest first (``ladder`` holds the rungs that were reached).
    rungs: list[str] = field(default_factory=list)
    #: Width per projection path that narrow and per-query serve with (empty when no calibrated
    #: rung ran): the load-time widths as calibrated on the probe's activations.
    widths: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Verdict:
        """A verdict from ``to_json``'s output; ``ValueError`` unless every field has its exact
        shape (a stored verdict decides which kernels serve, so nothing in it is taken on trust)."""
        _check(data, _VERDICT_FIELDS, "verdict")
        ladder = []
        for i, lr in enumerate(data["ladder"]):
            _check(lr, _LEVEL_FIELDS, f"verdict.ladder[{i}]")
            for j, d in enumerate(lr["draws"]):
                _check(d, _DRAW_FIELDS, f"verdict.ladder[{i}].draws[{j}]")
            draws = [DrawResult(**d) for d in lr["draws"]]
            ladder.append(LevelResult(**{**lr, "draws": draws}))
        verdict = cls(**{**data, "ladder": ladder})
        verdict._check_consistent()
        return verdict

    def _check_consistent(self) -> None:
        """``ValueError`` unless the fields agree with each other as the probe writes them: the
        rungs reached are the ladder's first ones, in order; a level is a rung that ran (and passed,
        if the verdict says exact); widths are stored exactly when a calibrated rung ran, so a
        verdict at narrow or per-query never serves with widths its draws did not check."""
        reached = [lr.level for lr in self.ladder]
        if reached != self.rungs[: len(reached)]:
            raise ValueError(f"the rungs reached {reached} are not the first of the ladder {self.rungs}")
        if any(lr.skipped and lr.draws for lr in self.ladder):
            raise ValueError("a skipped rung has draws")
        ran = {lr.level: lr for lr in self.ladder if not lr.skipped}
        if self.level is not None and self.level not in ran:
            raise ValueError(f"the verdict's level {self.level} is not a rung that ran")
        if self.exact and (self.level is None or not ran[self.level].exact):
            raise ValueError("an exact verdict without an exact rung")
        calibrated = any(Level(lr.level).calibrated and lr.draws for lr in self.ladder)
        if calibrated != bool(self.widths):
            raise ValueError("widths are stored exactly when a calibrated rung ran")


# What a stored verdict may hold, field by field: the persisted form is checked, never trusted.
_LEVELS = frozenset(level.value for level in Level)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _is_level(v: Any) -> bool:
    return isinstance(v, str) and v in _LEVELS


def _is_list(v: Any) -> bool:
    return isinstance(v, list)


def _is_width(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_MEASURED_WIDTH


def _is_widths(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _is_width(w) for k, w in v.items())


def _is_narrowed(v: Any) -> bool:
    def pair(p: Any) -> bool:
        return isinstance(p, list) and len(p) == 2 and all(_is_width(w) for w in p) and p[1] < p[0]

    return isinstance(v, dict) and all(isinstance(k, str) and pair(p) for k, p in v.items())


def _is_levels(v: Any) -> bool:
    return isinstance(v, list) and all(_is_level(x) for x in v)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


_DRAW_FIELDS: dict[str, Callable[[Any], bool]] = {
    "draw": _is_str,
    "context": _is_count,
    "exact": _is_bool,
    "nondeterministic": _is_bool,
    "first_position": _optional(_is_count),
    "differing_bytes": _is_count,
    "total_bytes": _is_count,
    "chain_vs_chain_bytes": _is_count,
    "accepted_as_classic_variation": _is_bool,
    "seconds": _is_seconds,
    "first_divergence": _optional(_is_str),
    "narrowed": _is_count,
}
_LEVEL_FIELDS: dict[str, Callable[[Any], bool]] = {
    "level": _is_level,
    "exact": _is_bool,
    "draws": _is_list,
    "seconds": _is_seconds,
    "narrowed": _is_narrowed,
    "skipped": _optional(_is_str),
}
_VERDICT_FIELDS: dict[str, Callable[[Any], bool]] = {
    "fingerprint": _is_str,
    "pairing": lambda v: isinstance(v, dict),
    "level": _optional(_is_level),
    "exact": _is_bool,
    "reason": _is_str,
    "ladder": _is_list,
    "probe_seconds": _is_seconds,
    "created": _is_seconds,
    "from_cache": _is_bool,
    "rungs": _is_levels,
    "widths": _is_widths,
}


def _check(data: Any, fields: dict[str, Callable[[Any], bool]], what: str) -> None:
    """``data`` is an object with exactly ``fields``, each passing its check; else ``ValueError``."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} is not an object")
    if set(data) != set(fields):
        missing, extra = sorted(set(fields) - set(data)), sorted(map(str, set(data) - set(fields)))
        raise ValueError(f"{what} has missing fields {missing} or unknown fields {extra}")
    for name, ok in fields.items():
        if not ok(data[name]):
            raise ValueError(f"{what}.{name} is not valid: {data[name]!r:.60}")


@dataclass(frozen=True)
class ProbePolicy:
    allow_inexact: bool = False
    pinned_level: Level | None = None
    accept_classic_variation: bool = False
    localize: bool = False


# --------------------------------------------------------------------------- draws


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


# --------------------------------------------------------------------------- running one draw


MakeCache = Callable[[], list[Any]]


def _prefill(model: Any, cache: list[Any], tokens: list[int], step: int = 2048) -> None:
    for i in range(0, len(tokens), step):
        model(mx.array([tokens[i : i + step]]), cache=cache)
        mx.eval([c.state for c in cache])


def chain_level(level: Level) -> Level:
    """The level classic decode runs at while ``level`` is the verdict: wide, except for a rung
    that pins the chain too (``padded``)."""
    return level if level.pins_chain else Level.WIDE


def run_chain(
    model: Any, make_cache: MakeCache, draw: Draw, width: int, level: Level = Level.WIDE
) -> tuple[mx.array, list[int]]:
    """Classic decode: ``width`` single-token forwards at ``level``, feeding its own argmax."""
    cache = make_cache()
    _prefill(model, cache, draw.prompt[:-1])
    token = draw.prompt[-1]
    fed, rows = [], []
    with scoped(level):
        for _ in range(width):
            fed.append(token)
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
            mx.eval(logits)
            rows.append(logits)
            token = as_int(mx.argmax(logits))
    return mx.stack(rows), fed


def run_block(
    model: Any,
    make_cache: MakeCache,
    draw: Draw,
    tokens: list[int],
    level: Level,
    calls: list[kernels.CapturedCall] | None = None,
) -> mx.array:
    """One forward over ``tokens`` at ``level`` on a freshly prefilled cache; with ``calls``, the
    block's own projection calls (never the prefill's) are captured into it for calibration."""
    cache = make_cache()
    _prefill(model, cache, draw.prompt[:-1])
    with scoped(level), kernels.capturing(calls) if calls is not None else nullcontext():
        layers = wrap_caches(cache) if level.per_query else cache
        logits = model(mx.array([tokens]), cache=layers)[0]
        mx.eval(logits)
    return logits


def run_calibrated_block(
    model: Any, make_cache: MakeCache, draw: Draw, tokens: list[int], level: Level
) -> tuple[mx.array, dict[int, tuple[int, int]]]:
    """``run_block`` at a calibrated level, with every width verified on the rows this block feeds
    its module: where one does not hold it is narrowed and the block run again (narrower widths
    change the activations downstream, so until a run narrows nothing). Returns the block's logits
    and ``{module id: (width before, width after)}`` for the modules narrowed."""
    narrowed: dict[int, tuple[int, int]] = {}
    for _ in range(MAX_CALIBRATION_PASSES):
        calls: list[kernels.CapturedCall] = []
        block = run_block(model, make_cache, draw, tokens, level, calls)
        changed = kernels.calibrate(calls)
        if not changed:
            return block, narrowed
        for mid, (before, after) in changed.items():
            narrowed[mid] = (narrowed.get(mid, (before, after))[0], after)
    return run_block(model, make_cache, draw, tokens, level), narrowed


def layout_stable(make_cache: MakeCache) -> MakeCache:
    """``make_cache`` whose caches grow in ``LAYOUT_STEP`` tokens, as a burst's caches do."""

    def make() -> list[Any]:
        cache = make_cache()
        kernels.stabilize_layout(cache)
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


# --------------------------------------------------------------------------- localizing


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
        _prefill(model, cache, draw.prompt[:-1])
        hooks.store.clear()
        with scoped(chain_level(level)):
            for t in tokens:
                model(mx.array([[t]]), cache=cache)
        chain = {k: v[:] for k, v in hooks.store.items()}
        cache = make_cache()
        _prefill(model, cache, draw.prompt[:-1])
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


# --------------------------------------------------------------------------- the ladder


LadderOutcome = tuple[Level | None, bool, str, list[LevelResult]]


def ladder_steps(
    model: Any,
    make_cache: MakeCache,
    draws: list[Draw],
    k: int,
    policy: ProbePolicy = ProbePolicy(),
    levels: tuple[Level, ...] | None = None,
) -> Generator[str, None, LadderOutcome]:
    """The ladder, one draw per step: yields a label before each draw and returns
    (level or None, exact, reason, per-level results). The engine drives it a step at a time
    between batched steps; ``run_ladder`` drives it to the end. Widths start from the load-time
    measurement and are calibrated at each calibrated rung (they stay narrowed for later rungs)."""
    install()
    make_cache = layout_stable(make_cache)
    kernels.reset_widths(model)
    paths = {id(m): path for path, m in model.named_modules()}
    width = k + 1
    #: Classic decode per (draw, the level it runs at): run twice, the second only to see it reproduce.
    baselines: dict[tuple[str, Level], tuple[mx.array, list[int], int]] = {}
    if policy.pinned_level is not None:
        levels = (policy.pinned_level,)
    elif levels is None:
        levels = kernels.ladder()
    results: list[LevelResult] = []
    for i, level in enumerate(levels):
        lr = LevelResult(level.value, exact=True)
        if level is Level.PER_QUERY and Level.PER_QUERY_1 in levels[i + 1 :] and kernels.every_width_one(model):
            lr.exact, lr.skipped = False, "calibration left every projection at one row: this is per-query-1"
            results.append(lr)
            continue
        tic_level = time.perf_counter()
        queue, ran = list(draws), set[str]()
        while queue:
            draw = queue.pop(0)
            yield f"{level.value}: {draw.name}" + (" (again, with narrowed widths)" if draw.name in ran else "")
            ran.add(draw.name)
            tic = time.perf_counter()
            base = (draw.name, chain_level(level))
            if base not in baselines:
                chain1, fed = run_chain(model, make_cache, draw, width, base[1])
                chain2, _ = run_chain(model, make_cache, draw, width, base[1])
                baselines[base] = (chain1, fed, compare(chain1, chain2)[1])
            chain, fed, classic_var = baselines[base]
            narrowed: dict[int, tuple[int, int]] = {}
            if level.calibrated:
                block, narrowed = run_calibrated_block(model, make_cache, draw, fed, level)
            else:
                block = run_block(model, make_cache, draw, fed, level)
            for mid, (before, after) in narrowed.items():
                path = paths.get(mid, str(mid))
                lr.narrowed[path] = [lr.narrowed.get(path, [before])[0], after]
            first, diff, total = compare(chain, block)
            dr = DrawResult(
                draw.name,
                len(draw.prompt),
                exact=diff == 0,
                first_position=first,
                differing_bytes=diff,
                total_bytes=total,
                chain_vs_chain_bytes=classic_var,
                narrowed=len(narrowed),
            )
            if classic_var:
                dr.nondeterministic = True
                dr.accepted_as_classic_variation = policy.accept_classic_variation and diff <= classic_var
                dr.exact = False
            if not dr.exact and first is not None and policy.localize:
                dr.first_divergence = localize(model, make_cache, draw, fed, level, first)
            dr.seconds = time.perf_counter() - tic
            if narrowed and lr.draws and (dr.exact or dr.accepted_as_classic_variation):
                # The rung's earlier draws passed with wider widths: the widths a verdict carries
                # must hold on every draw, so the rung starts over with these.
                lr.draws, queue = [], list(draws)
                continue
            lr.draws.append(dr)
            if not (dr.exact or dr.accepted_as_classic_variation):
                lr.exact = False
                break  # stop at the first divergence
        lr.seconds = time.perf_counter() - tic_level
        results.append(lr)
        if lr.exact:
            if any(d.nondeterministic for d in lr.draws):
                # Accepted by policy, but nothing is byte-identical to guarantee: not exact.
                return (
                    level,
                    False,
                    "no worse than classic decode's own run-to-run variation (operator policy)",
                    results,
                )
            return level, True, "exact at every draw" + _calibration_note(results), results
    last = next(lr for lr in reversed(results) if lr.draws).draws[-1]
    failed = next(lr for lr in reversed(results) if lr.draws).level
    why = (
        f"classic decode is not reproducible at draw {last.draw} ({last.chain_vs_chain_bytes} bytes differ chain vs chain)"
        if last.nondeterministic
        else f"no level is exact: at {failed}, draw {last.draw} position {last.first_position} "
        f"differs in {last.differing_bytes} of {last.total_bytes} logit bytes"
    )
    if policy.pinned_level is not None:
        return (
            policy.pinned_level,
            False,
            f"operator pinned {policy.pinned_level.value}, which is inexact: {why}",
            results,
        )
    if policy.allow_inexact:
        return Level.WIDE, False, f"--allow-inexact: bursts run at wide, marked inexact ({why})", results
    return None, False, f"declined: {why}", results


def _calibration_note(results: list[LevelResult]) -> str:
    narrowed = {path for lr in results for path in lr.narrowed}
    if not narrowed:
        return ""
    return f"; {len(narrowed)} projection widths narrowed by calibration on the probe's activations"


def drive(steps: Generator[str, None, Any], progress: Callable[[str], None] | None = None) -> Any:
    """Run a step generator to its end and return its value."""
    while True:
        try:
            label = next(steps)
        except StopIteration as done:
            return done.value
        if progress is not None:
            progress(label)


# --------------------------------------------------------------------------- fingerprints and memo


def _file_sha256(path: Path, memo: dict[str, Any]) -> str:
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    if key not in memo:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        memo[key] = h.hexdigest()
    return str(memo[key])


def model_fingerprint(model_dir: Path, cache_dir: Path) -> str:
    """sha256 over the config and every weight file's content (file hashes memoised by size
    and mtime, so a 5 GB checkpoint is read once)."""
    memo_path = cache_dir / "file-hashes.json"
    memo: dict[str, Any] = json.loads(memo_path.read_text()) if memo_path.exists() else {}
    h = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.suffix in (".safetensors", ".json") and path.is_file():
            h.update(path.name.encode())
            h.update(_file_sha256(path, memo).encode())
    cache_dir.mkdir(parents=True, exist_ok=True)
    memo_path.write_text(json.dumps(memo))
    return h.hexdigest()


def backend_fingerprint() -> dict[str, str]:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {
        "device": str(mx.default_device()),
        "device_name": str(info.get("device_name", "")),
        "architecture": str(info.get("architecture", "")),
        "mlx": str(getattr(mx, "__version__", "unknown")),
    }


def pairing_fingerprint(pairing: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps({**pairing, "probe_version": PROBE_VERSION}, sort_keys=True).encode()).hexdigest()


class VerdictStore:
    """Verdicts as JSON files named by fingerprint."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, fingerprint: str) -> Path:
        return self.root / f"{fingerprint}.json"

    def get(self, fingerprint: str) -> Verdict | None:
        """The stored verdict for ``fingerprint``, or ``None`` (probe again) when there is none or
        the file does not hold a valid verdict for exactly this pairing: a damaged or forged
        file is never trusted, and says so in the log."""
        path = self.path(fingerprint)
        if not path.exists():
            return None
        try:
            verdict = Verdict.from_json(json.loads(path.read_text()))
            if verdict.fingerprint != fingerprint or pairing_fingerprint(verdict.pairing) != fingerprint:
                raise ValueError("it is the verdict of another pairing")
        except Exception as exc:  # anything in the file, however odd, means "probe again"
            log.warning("ignoring the stored verdict %s (%s); the pairing is probed again", path, exc)
            return None
        verdict.from_cache = True
        return verdict

    def put(self, verdict: Verdict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path(verdict.fingerprint).with_suffix(".tmp")
        tmp.write_text(json.dumps(verdict.to_json(), indent=2))
        tmp.replace(self.path(verdict.fingerprint))


def probe_steps(
    model: Any,
    make_cache: MakeCache,
    pairing: dict[str, Any],
    draws: list[Draw],
    k: int,
    store: VerdictStore | None = None,
    policy: ProbePolicy = ProbePolicy(),
    force: bool = False,
) -> Generator[str, None, Verdict]:
    """The verdict for ``pairing`` (a JSON-able description including the model's fingerprint,
    the drafter and the backend), from the store when its fingerprint is known, else measured a
    draw per step. Either way the verdict's widths are what narrow and per-query serve with after it."""
    full = {
        **pairing,
        "k": k,
        "policy": {k2: str(v) for k2, v in asdict(policy).items()},
        "draws": [(d.name, len(d.prompt)) for d in draws],
        "layout_step": LAYOUT_STEP,
        "pad_rows": kernels.PAD_ROWS,
    }
    fp = pairing_fingerprint(full)
    if store is not None and not force:
        cached = store.get(fp)
        if cached is not None:
            kernels.apply_widths(model, cached.widths)
            return cached
    tic = time.perf_counter()
    rungs = (policy.pinned_level,) if policy.pinned_level is not None else kernels.ladder()
    level, exact, reason, ladder = yield from ladder_steps(model, make_cache, draws, k, policy, rungs)
    verdict = Verdict(
        fp,
        full,
        None if level is None else level.value,
        exact,
        reason,
        ladder,
        time.perf_counter() - tic,
        rungs=[r.value for r in rungs],
    )
    if any(Level(lr.level).calibrated and lr.draws for lr in ladder):
        verdict.widths = kernels.widths_by_path(model)
    kernels.apply_widths(model, verdict.widths)
    if store is not None:
        store.put(verdict)
    return verdict


def failed_verdict(name: str, exc: BaseException) -> Verdict:
    """A probe that raised: declined, with the error as the reason (fail closed)."""
    return Verdict("", {"pairing": name}, None, False, f"declined: the probe failed: {exc!r}", [], 0.0)


def probe(
    model: Any,
    make_cache: MakeCache,
    pairing: dict[str, Any],
    draws: list[Draw],
    k: int,
    store: VerdictStore | None = None,
    policy: ProbePolicy = ProbePolicy(),
    progress: Callable[[str], None] | None = None,
    force: bool = False,
) -> Verdict:
    return drive(probe_steps(model, make_cache, pairing, draws, k, store, policy, force), progress)


def iter_table(verdict: Verdict) -> Iterator[tuple[str, str, str, str, str]]:
    """Rows of (level, result, first position, draw, seconds) for printing: every rung reached,
    in ladder order, the winning one marked ``(won)``."""
    deciding = _deciding_rung(verdict)
    for lr in verdict.ladder:
        name = f"{lr.level} (won)" if lr is deciding else lr.level
        if lr.skipped:
            yield name, f"skipped: {lr.skipped}", "-", "-", "0.00"
        for d in lr.draws:
            if d.exact:
                result = "exact"
            elif d.nondeterministic:
                result = f"nondeterministic: block {d.differing_bytes} / chain-vs-chain {d.chain_vs_chain_bytes} of {d.total_bytes} B"
            else:
                result = f"{d.differing_bytes} / {d.total_bytes} B differ"
            if d.first_divergence:
                result += f" (first: {d.first_divergence})"
            if d.narrowed:
                result += f" (calibration narrowed {d.narrowed} projection widths)"
            pos = "-" if d.first_position is None else str(d.first_position)
            yield name, result, pos, f"{d.draw} ({d.context} tok)", f"{d.seconds:.2f}"


def _deciding_rung(verdict: Verdict) -> LevelResult | None:
    """The rung that passed and gave the verdict its level (``None`` when none did: declined, or a
    level the operator forced onto a rung that differs)."""
    return next((lr for lr in verdict.ladder if lr.level == verdict.level and lr.exact and not lr.skipped), None)


def ladder_line(verdict: Verdict) -> str:
    """One line for people: every rung of the ladder and how it ended, e.g.
    ``wide: differs -> narrow: differs -> per-query: skipped -> per-query-1: exact (won)``."""
    reached = {lr.level: lr for lr in verdict.ladder}
    deciding = _deciding_rung(verdict)
    parts = []
    for rung in verdict.rungs or [lr.level for lr in verdict.ladder]:
        lr = reached.get(rung)
        if lr is None:
            state = "not needed" if verdict.exact else "not run"
        elif lr.skipped:
            state = "skipped"
        elif lr.exact:
            state = "exact" if verdict.exact else "accepted"
        elif any(d.nondeterministic for d in lr.draws):
            state = "classic not reproducible"
        else:
            state = "differs"
        parts.append(f"{rung}: {state}" + (" (won)" if lr is not None and lr is deciding else ""))
    return " -> ".join(parts)


def narrowed_widths(verdict: Verdict) -> dict[str, list[int]]:
    """Every projection the probe's calibration narrowed: path -> [load-time width, served width]."""
    out: dict[str, list[int]] = {}
    for lr in verdict.ladder:
        for path, (before, after) in lr.narrowed.items():
            out[path] = [out.get(path, [before])[0], after]
    return out


# --------------------------------------------------------------------------- serving's pairing


def serving_pairing(
    model_dir: Path, config: dict[str, Any], drafter: str, cache: list[Any], cache_root: Path
) -> dict[str, Any]:
    """Everything that can change a verdict: weights and config, dtype and quantization (both in
    the config and the weights), drafter, the cache types serving builds, backend and versions."""
    return {
        "model": model_fingerprint(model_dir, cache_root),
        "model_type": config.get("model_type"),
        "quantization": config.get("quantization"),
        "drafter": drafter,
        "caches": [type(c).__name__ + (f"({c.max_size})" if hasattr(c, "max_size") else "") for c in cache],
        "backend": backend_fingerprint(),
    }
