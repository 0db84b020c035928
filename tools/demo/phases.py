"""One training phase (its spec, learning-rate schedule, batches and loop), and the batches that mix
corpus windows with the target's own generations for distillation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np


@dataclass
class PhaseSpec:
    """One training phase's knobs. ``steps`` = 0 means: fix the count from ``seconds`` after warm-up."""

    name: str
    lr: float
    batch: int
    steps: int = 0
    seconds: float = 60.0
    warmup: int = 100
    max_steps: int = 100_000
    weight_decay: float = 0.1


@dataclass
class PhaseResult:
    name: str
    steps: int
    seconds: float
    tokens: int
    final_train_loss: float  # mean loss over the last 5% of steps (at least 10)
    step_seconds: float
    losses: list[float] = field(default_factory=list)  # mean per 100 steps


def lr_at(step: int, spec: PhaseSpec, total: int) -> float:
    """Linear warm-up, then cosine decay to 10%. Warm-up does not depend on ``total`` (see module doc)."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = min(1.0, (step - spec.warmup) / max(1, total - spec.warmup))
    return spec.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def file_starts(tokens: np.ndarray, eos: int) -> np.ndarray:
    """Positions where a file begins in :func:`encode_files`' stream: 0 and after every EOS."""
    return np.concatenate([[0], np.flatnonzero(tokens[:-1] == eos) + 1]).astype(np.int64)


def window_starts(
    rng: np.random.Generator, n: int, hi: int, starts_at: np.ndarray | None = None, share: float = 0.0
) -> np.ndarray:
    """``n`` window starts below ``hi``: ``share`` of them drawn from ``starts_at``, the rest uniform.

    Why: uniform windows almost never begin at a file's first byte, so a model trained only on them
    has never seen position 0 be the top of a file, and a bare prompt like ``def f(n):`` leaves it
    guessing the indentation. Some windows aligned to file starts teach it what a beginning looks like.
    """
    usable = starts_at[starts_at < hi] if starts_at is not None and share > 0 else np.empty(0, np.int64)
    k = round(n * share) if len(usable) else 0
    uniform = rng.integers(0, hi, size=n - k)
    return np.concatenate([uniform, rng.choice(usable, size=k)]) if k else uniform


def batches(
    tokens: np.ndarray,
    batch: int,
    seq: int,
    rng: np.random.Generator,
    starts_at: np.ndarray | None = None,
    start_share: float = 0.0,
) -> Iterator[mx.array]:
    """Endless random windows of ``seq + 1`` tokens (inputs plus shifted labels), ``[batch, seq + 1]``;
    ``start_share`` of them begin at one of ``starts_at`` (see :func:`window_starts`)."""
    hi = len(tokens) - seq - 1
    while True:
        starts = window_starts(rng, batch, hi, starts_at, start_share)
        yield mx.array(np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int32))


def train_phase(
    spec: PhaseSpec,
    seq_len: int,
    module: nn.Module,
    loss_fn: Callable[..., mx.array],
    data: Iterator[mx.array],
    extra_state: list,
    compile_step: bool,
    log: Callable[[str], None],
    every: tuple[int, Callable[[int], None]] | None = None,
) -> PhaseResult:
    """Generic AdamW loop over ``module``'s trainable parameters.

    ``loss_fn(module, window)`` returns a scalar. ``extra_state`` lists frozen arrays the loss reads
    (a teacher's parameters) so a compiled step sees them as inputs rather than baked-in constants.
    ``every = (n, fn)`` calls ``fn(step)`` every ``n`` steps (held-out curves for the report).
    """
    opt = optim.AdamW(learning_rate=spec.lr, betas=[0.9, 0.95], weight_decay=spec.weight_decay)
    value_and_grad = nn.value_and_grad(module, loss_fn)

    def step(window: mx.array) -> mx.array:
        loss, grads = value_and_grad(module, window)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(module, grads)
        return loss

    state = [module.state, opt.state]
    fn = mx.compile(step, inputs=state + extra_state, outputs=state) if compile_step else step
    total = spec.steps or spec.max_steps
    losses: list[float] = []
    t0 = time.perf_counter()
    t_probe0 = None
    probe_from, probe_to = min(10, spec.warmup // 4), min(60, spec.warmup)
    s = 0
    while s < total:
        opt.learning_rate = mx.array(lr_at(s, spec, total), dtype=mx.float32)
        window = next(data)
        if s == 0 and fn is not step:
            try:  # a backend that cannot compile this step should cost speed, not the run
                loss = fn(window)
                mx.eval(loss, state)
            except Exception as e:  # noqa: BLE001
                log(f"[{spec.name}] compiled step failed ({type(e).__name__}: {e}); running uncompiled")
                fn = step
                loss = fn(window)
        else:
            loss = fn(window)
        mx.eval(loss, state)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"{spec.name}: loss {losses[-1]} at step {s}")
        s += 1
        if spec.steps == 0 and s == probe_from:
            t_probe0 = time.perf_counter()
        if spec.steps == 0 and s == probe_to:
            per = (time.perf_counter() - t_probe0) / (probe_to - probe_from)
            total = int(min(spec.max_steps, (spec.seconds - (time.perf_counter() - t0)) / per + s))
            total = max(total // 50 * 50, spec.warmup + 50)
            log(f"[{spec.name}] {per * 1000:.1f} ms/step -> {total} steps for {spec.seconds:.0f} s")
        if every is not None and (s % every[0] == 0 or s == total):
            every[1](s)
        if s % 100 == 0 or s == total:
            log(
                f"[{spec.name}] step {s}/{total} loss {np.mean(losses[-100:]):.4f} "
                f"lr {lr_at(s - 1, spec, total):.2e} {time.perf_counter() - t0:.0f}s"
            )
    dt = time.perf_counter() - t0
    tail = max(10, len(losses) // 20)
    return PhaseResult(
        name=spec.name,
        steps=total,
        seconds=dt,
        tokens=total * spec.batch * seq_len,
        final_train_loss=float(np.mean(losses[-tail:])),
        step_seconds=dt / total,
        losses=[float(np.mean(losses[i : i + 100])) for i in range(0, len(losses), 100)],
    )


def generate_pool(
    target: nn.Module,
    tokens: np.ndarray,
    n_seqs: int,
    prompt_len: int,
    gen_len: int,
    batch: int,
    rng: np.random.Generator,
    max_seconds: float,
    log: Callable[[str], None],
    def_ends: np.ndarray | None = None,
    def_fraction: float = 0.0,
) -> np.ndarray:
    """The target's own greedy continuations of random training windows, ``[N, prompt_len + gen_len]``.

    Why: acceptance is measured on what the target generates, so the drafters also learn from that
    (on-policy distillation), not only from human-written code. Stops early (whole batches) after
    ``max_seconds``; the report records how many sequences were made. With ``def_fraction`` > 0 that
    share of each batch's prompts ends at a def/class header (``def_ends``, see :func:`def_prompt_ends`).
    """
    from mlx_lm.models.cache import make_prompt_cache

    rows: list[np.ndarray] = []
    t0 = time.perf_counter()
    hi = len(tokens) - prompt_len
    while sum(len(r) for r in rows) < n_seqs and time.perf_counter() - t0 < max_seconds:
        n_def = round(batch * def_fraction) if def_ends is not None and len(def_ends) else 0
        starts = rng.integers(0, hi, size=batch - n_def)
        if n_def:
            usable = def_ends[def_ends >= prompt_len]
            starts = np.concatenate([starts, rng.choice(usable, size=n_def) - prompt_len])
        prompts = mx.array(np.stack([tokens[st : st + prompt_len] for st in starts]).astype(np.int32))
        cache = make_prompt_cache(target)
        logits = target(prompts, cache=cache)
        out = [mx.argmax(logits[:, -1, :], axis=-1)]
        for _ in range(gen_len - 1):
            logits = target(out[-1][:, None], cache=cache)
            out.append(mx.argmax(logits[:, -1, :], axis=-1))
            mx.eval(out[-1])
        rows.append(np.concatenate([np.array(prompts), np.array(mx.stack(out, axis=1))], axis=1).astype(np.uint16))
    pool = np.concatenate(rows, axis=0)
    log(f"pool: {len(pool)} greedy continuations of {gen_len} tokens in {time.perf_counter() - t0:.1f}s")
    return pool


def mixed_batches(
    tokens: np.ndarray,
    pool: np.ndarray,
    batch: int,
    rng: np.random.Generator,
    pool_share: float = 0.5,
    starts_at: np.ndarray | None = None,
    start_share: float = 0.0,
) -> Iterator[mx.array]:
    """Real training windows plus ``pool_share`` of rows from the on-policy pool, ``pool.shape[1]`` tokens each.

    ``start_share`` of the real windows begin at one of ``starts_at`` (see :func:`window_starts`)."""
    width = pool.shape[1]
    n_pool = min(batch, round(batch * pool_share))
    hi = len(tokens) - width
    while True:
        starts = window_starts(rng, batch - n_pool, hi, starts_at, start_share)
        real = [tokens[s : s + width] for s in starts]
        gen = pool[rng.integers(0, len(pool), size=n_pool)]
        yield mx.array(np.concatenate([np.asarray(real, dtype=pool.dtype).reshape(-1, width), gen]).astype(np.int32))
