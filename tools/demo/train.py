"""Train the demo model set: a target LM, a small draft LM and an MTP head, all with MLX.

Why it exists: ``mlx-batchd serve --model demo`` must produce recognisable text on any machine, offline,
and speculative decoding must show real acceptance, so the repository ships a small, genuinely trained
target with two drafters. Everything here is deterministic given ``--seed`` and the step counts (data
order and initialisation are seeded; GPU reductions may still differ in the last bits).

Corpus: the ``.py`` files of a CPython standard library (by default the running interpreter's), minus
generated data modules and a fixed held-out set (see :func:`select_files`). Nothing is downloaded.

Phases (each saves its result as soon as it ends):

1. tokenizer: bytes (257 tokens with EOS; ``--vocab-size N`` fits a byte-level BPE of N instead);
2. target: llama-style, trained from scratch on next-token cross-entropy, then cast to bf16 (what ships);
3. draft: a shallow llama distilled from the bf16 target (soft cross-entropy against its distribution),
   because acceptance is agreement with the target, not with the data. By default it starts as the
   target's embedding, first ``--draft-layers`` blocks and final norm (an early exit of the target), so
   distillation refines a model that already agrees with the target instead of learning from nothing;
4. MTP head: distilled from the bf16 target's next-next-token distribution, trained chained to depth
   ``--mtp-depth`` exactly as it is used in drafting (see :func:`mtp_chain`).

Step counts: give ``--target-steps`` etc. for a reproducible run; or a time budget per phase
(``--target-seconds`` ...), in which case the first steps are timed during warm-up (whose learning rate
does not depend on the total) and the count is fixed from them and recorded in the report. Either way
the report (``train_report.json``) records the exact counts, so a rerun with them is the same run.

Run from the repository root: ``python -m tools.demo.train`` (writes ``workers/demo/weights``, the shipped
set, unless ``--out`` says otherwise; see docs/demo-models.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import re
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from tools.demo.tokenizer import BYTE_VOCAB_SIZE, EOS_TOKEN, save_tokenizer, train_tokenizer
from workers import mtp as mtp_mod
from workers.demo import SHIPPED

# --------------------------------------------------------------------------------------------- corpus

# Held-out modules: small, self-contained pure-Python files that make natural code prompts. Their own
# tests are dropped from training too (see _LEAKY_TESTS), so held-out code was never seen in any form.
HELDOUT_FILES = (
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "difflib.py",
    "fractions.py",
    "graphlib.py",
    "heapq.py",
    "sched.py",
    "shlex.py",
    "statistics.py",
    "textwrap.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "json/scanner.py",
    "json/tool.py",
)
_LEAKY_TESTS = tuple(f"test/test_{Path(p).stem}.py" for p in HELDOUT_FILES if "/" not in p) + ("test/test_json/",)
# Generated data rather than code: codec tables and the pydoc topic dump. site-packages is not stdlib.
_EXCLUDED_DIRS = ("site-packages/", "dist-packages/", "encodings/", "pydoc_data/")
MAX_FILE_BYTES = 256 * 1024  # larger .py files are generated tables, not code worth imitating


@dataclass(frozen=True)
class Corpus:
    """The selected source files, as paths relative to the stdlib root, sorted."""

    root: Path
    train: tuple[str, ...]
    heldout: tuple[str, ...]

    def digest(self) -> str:
        """SHA-256 over every selected file's name and bytes: identifies the exact corpus."""
        h = hashlib.sha256()
        for rel in self.train + ("--heldout--",) + self.heldout:
            h.update(rel.encode() + b"\0")
            if rel != "--heldout--":
                h.update((self.root / rel).read_bytes())
        return h.hexdigest()


def default_stdlib() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_source(path: Path) -> str | None:
    """The file as text, or None if it is not UTF-8 (a handful of test files carry other encodings)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def select_files(root: Path) -> Corpus:
    """Split the stdlib's ``.py`` files into training and held-out sets (deterministic: sorted paths)."""
    train: list[str] = []
    heldout: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel or any(rel.startswith(d) or f"/{d}" in rel for d in _EXCLUDED_DIRS):
            continue
        if path.stat().st_size > MAX_FILE_BYTES or read_source(path) is None:
            continue
        if rel in HELDOUT_FILES:
            heldout.append(rel)
        elif rel in _LEAKY_TESTS or any(rel.startswith(t) for t in _LEAKY_TESTS if t.endswith("/")):
            continue
        else:
            train.append(rel)
    missing = set(HELDOUT_FILES) - set(heldout)
    if missing:
        raise ValueError(f"held-out files missing under {root}: {sorted(missing)}")
    return Corpus(root=root, train=tuple(train), heldout=tuple(heldout))


def encode_files(tokenizer, root: Path, files: tuple[str, ...]) -> np.ndarray:
    """Token ids of all files, each followed by EOS, as one uint16 stream (vocab < 65536)."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    texts = [read_source(root / f) or "" for f in files]
    out: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, dtype=np.uint16)


_DEF_END = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+\w+.*:[ \t]*$", re.M)


def def_prompt_ends(tokenizer, root: Path, files: tuple[str, ...]) -> np.ndarray:
    """Positions in :func:`encode_files`' stream just after the ``:`` of each one-line def/class header.

    Why: evaluation prompts end there (held-out functions, the demo's ``def fibonacci(n):``), so pool
    prompts that end there show the drafters how the target starts a body, not only mid-file text.
    """
    texts = [read_source(root / f) or "" for f in files]
    ends: list[int] = []
    base = 0
    for text, enc in zip(texts, tokenizer.encode_batch(texts)):
        tok_end = {e: i for i, (_, e) in enumerate(enc.offsets)}
        for m in _DEF_END.finditer(text):
            colon = m.start() + m.group(0).rstrip().rfind(":") + 1
            if colon in tok_end:
                ends.append(base + tok_end[colon] + 1)
        base += len(enc.ids) + 1
    return np.asarray(ends, dtype=np.int64)


# --------------------------------------------------------------------------------------------- models

# Byte-level: 256 byte tokens + EOS, no merges (see tools/demo/tokenizer.py for why). A larger value
# fits a byte-level BPE of that many entries instead (the first shipped set used 4096).
VOCAB_SIZE = BYTE_VOCAB_SIZE
# Training context: the evaluation prompts carry ~1200 bytes of their file before the def line, and a
# continuation of 256 bytes must still sit inside the positions the model was trained on.
SEQ_LEN = 1536
# Sizes chosen for a 2-core CPU with MLX's reference BLAS (docs/demo-models.md has the measurements):
# the target must decode >= 50 tok/s in bf16 at B = 1, and all weights must fit in 25 MB.
# --target-layers overrides the depth.
TARGET_SHAPE = dict(hidden_size=256, num_hidden_layers=6, intermediate_size=704, num_attention_heads=4)
# --draft-init scratch only; the default draft is the target's shape cut to --draft-layers blocks.
DRAFT_SHAPE = dict(hidden_size=192, num_hidden_layers=2, intermediate_size=512, num_attention_heads=3)
MTP_LAYERS = 1
# --smoke: tiny shapes so the whole pipeline runs on a CPU in seconds (tests of this script only).
SMOKE_SHAPES = (
    dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2),
    dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=1),
)


def llama_args(vocab_size: int, shape: dict) -> llama.ModelArgs:
    """mlx-lm llama arguments for one of our shapes (tied embeddings: half the table bytes)."""
    return llama.ModelArgs(
        model_type="llama",
        vocab_size=vocab_size,
        num_key_value_heads=shape["num_attention_heads"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **shape,
    )


def llama_config_json(args: llama.ModelArgs, eos_id: int) -> dict:
    """``config.json`` for mlx-lm (and transformers) from the model arguments."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def draft_from_target(target: llama.Model, target_shape: dict, layers: int) -> tuple[llama.Model, dict]:
    """A draft that starts as an early exit of ``target``: its embedding, first ``layers`` blocks, final norm.

    Why: acceptance is agreement with the target, and the target's own lower blocks plus its output head
    already agree with it far more than a randomly initialised model of the same size; distillation then
    only has to close the gap. Weights are copied as float32 for training (the target is bf16 by then).
    """
    shape = dict(target_shape, num_hidden_layers=min(layers, target_shape["num_hidden_layers"]))
    draft = llama.Model(llama_args(target.args.vocab_size, shape))
    keep = []
    for name, value in tree_flatten(target.parameters()):
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= shape["num_hidden_layers"]:
            continue
        keep.append((name, value.astype(mx.float32)))
    draft.load_weights(keep, strict=True)
    return draft, shape


def as_shipped(module: nn.Module) -> None:
    """Cast a trained module to bf16 in eval mode, evaluated: what ships, and what later phases read."""
    module.set_dtype(mx.bfloat16)
    module.eval()
    mx.eval(module.parameters())


def n_params(module: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()))


def save_llama(model: llama.Model, out_dir: Path, tokenizer, eos_id: int) -> None:
    """Write an mlx-lm model directory: config, bf16 safetensors, tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(llama_config_json(model.args, eos_id), indent=2) + "\n")
    save_tokenizer(tokenizer, out_dir, model_max_length=model.args.max_position_embeddings)


# ------------------------------------------------------------------------------------------- training


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


def ce_loss(model: nn.Module, window: mx.array) -> mx.array:
    """Next-token cross-entropy, mean over positions."""
    logits = model(window[:, :-1])
    return nn.losses.cross_entropy(logits.astype(mx.float32), window[:, 1:], reduction="mean")


def soft_ce(student_logits: mx.array, teacher_logits: mx.array) -> mx.array:
    """Cross-entropy of the student against the teacher's distribution, per position.

    Equals KL(teacher || student) plus the teacher's entropy, so its gradient is the KL's: the student
    learns the teacher's whole distribution, which is what greedy acceptance rewards.
    """
    p = mx.softmax(teacher_logits.astype(mx.float32), axis=-1)
    return -(p * nn.log_softmax(student_logits.astype(mx.float32), axis=-1)).sum(axis=-1)


def distill_loss(draft: nn.Module, window: mx.array, teacher: nn.Module) -> mx.array:
    teacher_logits = mx.stop_gradient(teacher(window[:, :-1]))
    return soft_ce(draft(window[:, :-1]), teacher_logits).mean()


# ------------------------------------------------------------------------------------ MTP chain train


def _shift_right(x: mx.array, n: int, axis: int) -> mx.array:
    """``x`` moved ``n`` places later along ``axis``, zeros in front (``y[j] = x[j - n]``)."""
    if n == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[axis] = n
    keep = [slice(None)] * x.ndim
    keep[axis] = slice(0, x.shape[axis] - n)
    return mx.concatenate([mx.zeros(pad_shape, dtype=x.dtype), x[tuple(keep)]], axis=axis)


def mtp_chain(head: mtp_mod.MTPHead, hidden: mx.array, next_tokens: mx.array, depth: int) -> list[mx.array]:
    """Logits of the head at chain depths ``1..depth`` for every position, in one parallel pass each.

    At depth ``s`` and array index ``j`` this computes exactly what drafting computes for the ``s``-th
    drafted token when the last committed position is ``t = j - s + 1``: the input is the head's own
    depth ``s - 1`` output at ``j - 1`` (the target's ``h_j`` at depth 1) with the embedding of the
    token at ``j + 1``; attention sees the true, depth-1 keys of positions ``<= t`` plus the chained
    keys of depths ``2..s`` at positions ``t + 1 .. j``, which is what the head's KV cache holds then.
    So every depth predicts the token at ``j + 2``, and the training signal matches inference.
    Only valid for ``j >= s - 1``; callers mask the rest.
    """
    B, T, _ = hidden.shape
    emb = head.embed_norm(head._target.embed(next_tokens))
    kv_by_depth: list[list[tuple[mx.array, mx.array]]] = []
    rows = mx.arange(T)[:, None]
    cols = mx.arange(T)[None, :]
    outs: list[mx.array] = []
    g = hidden
    for s in range(1, depth + 1):
        g_in = hidden if s == 1 else _shift_right(g, 1, axis=1)
        x = head.proj(mx.concatenate([head.hidden_norm(g_in), emb], axis=-1))
        layer_kv: list[tuple[mx.array, mx.array]] = []
        for li, layer in enumerate(head.layers):
            attn = layer.self_attn
            xn = layer.input_layernorm(x)
            q = attn.q_proj(xn).reshape(B, T, attn.n_heads, -1).transpose(0, 2, 1, 3)
            k = attn.k_proj(xn).reshape(B, T, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            v = attn.v_proj(xn).reshape(B, T, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            q, k = attn.rope(q), attn.rope(k)
            layer_kv.append((k, v))
            if s == 1:
                o = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask="causal")
            else:
                k1, v1 = kv_by_depth[0][li]
                scores = (q * attn.scale) @ k1.transpose(0, 1, 3, 2)
                scores = mx.where(cols <= rows - (s - 1), scores, mx.array(-1e9, scores.dtype))
                extra_k = [kv_by_depth[r - 1][li][0] if r < s else k for r in range(2, s + 1)]
                extra_v = [kv_by_depth[r - 1][li][1] if r < s else v for r in range(2, s + 1)]
                extra_k = [_shift_right(kr, s - r, axis=2) for r, kr in zip(range(2, s + 1), extra_k)]
                extra_v = [_shift_right(vr, s - r, axis=2) for r, vr in zip(range(2, s + 1), extra_v)]
                extra = [((q * attn.scale) * kr).sum(axis=-1, keepdims=True) for kr in extra_k]
                p = mx.softmax(mx.concatenate([scores] + extra, axis=-1), axis=-1, precise=True)
                o = p[..., :T] @ v1
                for i, vr in enumerate(extra_v):
                    o = o + p[..., T + i : T + i + 1] * vr
            o = o.transpose(0, 2, 1, 3).reshape(B, T, -1)
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        kv_by_depth.append(layer_kv)
        outs.append(head.logits(x))
        g = x
    return outs


def mtp_loss(head: mtp_mod.MTPHead, window: mx.array, target: nn.Module, depth: int) -> mx.array:
    """Mean soft cross-entropy against the target's own next-next distribution, over all depths."""
    T = window.shape[1] - 1
    logits_t, hidden = mtp_mod.target_forward(target, window[:, :-1])
    teacher = mx.stop_gradient(logits_t[:, 1:])  # teacher for index j is the target at j + 1
    hidden = mx.stop_gradient(hidden)
    outs = mtp_chain(head, hidden, window[:, 1:], depth)
    total = mx.array(0.0)
    for s, lg in enumerate(outs, start=1):
        per_pos = soft_ce(lg[:, s - 1 : T - 1], teacher[:, s - 1 :])
        total = total + per_pos.mean()
    return total / depth


# ------------------------------------------------------------------------------------------ metrics


def eval_windows(tokens: np.ndarray, seq: int, limit: int | None = None) -> list[np.ndarray]:
    """Non-overlapping ``seq + 1`` windows covering ``tokens`` (the last partial one dropped)."""
    n = (len(tokens) - 1) // seq
    wins = [tokens[i * seq : i * seq + seq + 1] for i in range(n)]
    return wins[:limit] if limit else wins


def sample_windows(tokens: np.ndarray, seq: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [tokens[s : s + seq + 1] for s in rng.integers(0, len(tokens) - seq - 1, size=n)]


def _chunks(wins: list[np.ndarray], bs: int) -> Iterator[mx.array]:
    for i in range(0, len(wins), bs):
        yield mx.array(np.stack(wins[i : i + bs]).astype(np.int32))


def lm_metrics(model: nn.Module, wins: list[np.ndarray], teacher: nn.Module | None = None) -> dict:
    """Cross-entropy (nats/token) on the data; with a teacher also top-1 agreement with its argmax."""
    ce_sum, agree, n = 0.0, 0, 0
    for w in _chunks(wins, 32):
        logits = model(w[:, :-1]).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, w[:, 1:], reduction="sum")
        if teacher is not None:
            a = (mx.argmax(logits, -1) == mx.argmax(teacher(w[:, :-1]), -1)).sum()
            mx.eval(ce, a)
            agree += a.item()
        ce_sum += ce.item()
        n += w[:, 1:].size
    out = {"ce": ce_sum / n, "tokens": n}
    if teacher is not None:
        out["top1_agree_target"] = agree / n
    return out


def mtp_metrics(head: mtp_mod.MTPHead, target: nn.Module, wins: list[np.ndarray], depth: int) -> dict:
    """Per chain depth: CE against the data token two ahead, and top-1 agreement with the target."""
    ce = np.zeros(depth)
    agree = np.zeros(depth)
    n = np.zeros(depth)
    for w in _chunks(wins, 32):
        T = w.shape[1] - 1
        logits_t, hidden = mtp_mod.target_forward(target, w[:, :-1])
        tgt_arg = mx.argmax(logits_t[:, 1:], -1)
        outs = mtp_chain(head, hidden, w[:, 1:], depth)
        for s, lg in enumerate(outs, start=1):
            lg = lg[:, s - 1 : T - 1].astype(mx.float32)
            labels = w[:, s + 1 :]
            c = nn.losses.cross_entropy(lg, labels, reduction="sum")
            a = (mx.argmax(lg, -1) == tgt_arg[:, s - 1 :]).sum()
            mx.eval(c, a)
            ce[s - 1] += c.item()
            agree[s - 1] += a.item()
            n[s - 1] += labels.size
    return {"ce_two_ahead": (ce / n).tolist(), "top1_agree_target": (agree / n).tolist()}


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=SHIPPED, help="default: the shipped set, workers/demo/weights")
    p.add_argument("--stdlib", type=Path, default=None, help="stdlib root (default: this interpreter's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-files", type=int, default=0, help="use only the first N training files (smoke tests)")
    p.add_argument("--mtp-depth", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help=f"{BYTE_VOCAB_SIZE}: bytes; more: a BPE")
    p.add_argument("--target-layers", type=int, default=0, help="0: the default shape's depth")
    # Default budgets fit one 10-minute device call; batches of 32 x 1536 bytes.
    for name, lr, batch, secs, cap in (
        ("target", 2e-3, 32, 230.0, 8000),
        ("draft", 3e-3, 32, 90.0, 6000),
        ("mtp", 2e-3, 32, 130.0, 6000),
    ):
        p.add_argument(f"--{name}-lr", type=float, default=lr)
        p.add_argument(f"--{name}-batch", type=int, default=batch)
        p.add_argument(f"--{name}-steps", type=int, default=0, help="0: fix from --*-seconds")
        p.add_argument(f"--{name}-seconds", type=float, default=secs)
        p.add_argument(f"--{name}-max-steps", type=int, default=cap)
    # Default none: on a fresh H200 compiling a phase's step cost ~70 s, more than the compiled target
    # step (28.5 ms vs 36.8 ms uncompiled) saves in a few-minute phase.
    p.add_argument("--compile", default="", help="comma list of phases whose step is mx.compile'd (target,draft,mtp)")
    # Pool rows are prompt + continuation = SEQ_LEN + 1 tokens, so drafters train on full-length windows.
    p.add_argument("--pool-seqs", type=int, default=49152, help="on-policy greedy continuations for the drafters")
    p.add_argument("--pool-prompt", type=int, default=1281)
    p.add_argument("--pool-gen", type=int, default=256)
    p.add_argument("--pool-batch", type=int, default=1024)
    p.add_argument("--pool-seconds", type=float, default=45.0)
    p.add_argument("--pool-def-fraction", type=float, default=0.5, help="share of pool prompts ending at a def line")
    p.add_argument("--pool-share", type=float, default=0.75, help="share of each drafter batch drawn from the pool")
    p.add_argument(
        "--file-start-share", type=float, default=0.0, help="share of real training windows that begin a file"
    )
    p.add_argument("--draft-init", choices=("target", "scratch"), default="target", help="target: early exit of it")
    p.add_argument(
        "--draft-layers", type=int, default=3, help="blocks of the target the draft keeps (--draft-init target)"
    )
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=0, help="cap held-out windows (0: all)")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--smoke", action="store_true", help="tiny shapes: test this script, not a real run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    log_lines: list[str] = []

    def log(msg: str) -> None:
        line = f"{time.perf_counter() - t_start:7.1f}s {msg}"
        print(line, flush=True)
        log_lines.append(line)

    mx.random.seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    root = (args.stdlib or default_stdlib()).resolve()
    corpus = select_files(root)
    train_files = corpus.train[: args.max_files] if args.max_files else corpus.train
    log(f"device {mx.default_device()}, stdlib {root}: {len(train_files)} train files, {len(corpus.heldout)} held-out")

    texts = (read_source(root / f) or "" for f in train_files)
    tok = train_tokenizer(texts, args.vocab_size)
    eos_id = tok.token_to_id(EOS_TOKEN)
    train_tokens = encode_files(tok, root, train_files)
    heldout_tokens = encode_files(tok, root, corpus.heldout)
    train_bytes = sum((root / f).stat().st_size for f in train_files)
    log(
        f"tokenizer: {tok.get_vocab_size()} tokens; train {len(train_tokens)} tokens "
        f"({train_bytes / len(train_tokens):.2f} bytes/token), held-out {len(heldout_tokens)}"
    )

    seq = args.seq_len
    target_shape, draft_shape = SMOKE_SHAPES if args.smoke else (TARGET_SHAPE, DRAFT_SHAPE)
    if args.target_layers:
        target_shape = dict(target_shape, num_hidden_layers=args.target_layers)
    vocab = tok.get_vocab_size()
    held_wins = eval_windows(heldout_tokens, seq, args.eval_windows or None)
    train_wins = sample_windows(train_tokens, seq, len(held_wins) or 8, seed=args.seed + 1)
    compiled = set(args.compile.split(",")) if args.compile else set()
    report: dict = {
        "command": " ".join(
            [Path(sys.executable).name, "-m", "tools.demo.train"] + (argv if argv is not None else sys.argv[1:])
        ),
        "seed": args.seed,
        "python_running": platform.python_version(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "stdlib_root": str(root),
        "corpus": {
            "digest": corpus.digest() if not args.max_files else None,
            "train_files": len(train_files),
            "train_bytes": train_bytes,
            "train_tokens": int(len(train_tokens)),
            "heldout_files": list(corpus.heldout),
            "heldout_tokens": int(len(heldout_tokens)),
            "heldout_windows": len(held_wins),
        },
        "vocab_size": vocab,
        "file_start_share": args.file_start_share,
        "seq_len": seq,
    }

    def phase_spec(name: str) -> PhaseSpec:
        a = vars(args)
        return PhaseSpec(
            name=name,
            lr=a[f"{name}_lr"],
            batch=a[f"{name}_batch"],
            steps=a[f"{name}_steps"],
            seconds=a[f"{name}_seconds"],
            warmup=args.warmup,
            max_steps=a[f"{name}_max_steps"],
        )

    # ---- target
    starts = file_starts(train_tokens, eos_id)
    target = llama.Model(llama_args(vocab, target_shape))
    mx.eval(target.parameters())
    spec = phase_spec("target")
    rng = np.random.default_rng(args.seed)
    curve: list[dict] = []

    def heldout_point(step: int) -> None:
        target.eval()
        curve.append({"step": step, "heldout_ce": lm_metrics(target, held_wins)["ce"]})
        target.train()
        log(f"[target] step {step}: held-out CE {curve[-1]['heldout_ce']:.4f}")

    res = train_phase(
        spec,
        seq,
        target,
        ce_loss,
        batches(train_tokens, spec.batch, seq, rng, starts, args.file_start_share),
        [],
        "target" in compiled,
        log,
        every=(args.eval_every, heldout_point),
    )
    as_shipped(target)  # the draft and the head learn from this exact model
    save_llama(target, out / "target", tok, eos_id)
    report["target"] = {
        "shape": target_shape,
        "params": n_params(target),
        "train": asdict(res),
        "heldout_curve": curve,
        "heldout": lm_metrics(target, held_wins),
        "train_sample": lm_metrics(target, train_wins),
    }
    log(
        f"target: held-out CE {report['target']['heldout']['ce']:.4f}, train-sample CE {report['target']['train_sample']['ce']:.4f}"
    )
    _write_report(out, report, log_lines)

    # ---- on-policy pool for the drafters
    t_pool = time.perf_counter()
    def_ends = def_prompt_ends(tok, root, train_files) if args.pool_def_fraction > 0 else None
    pool = generate_pool(
        target,
        train_tokens,
        args.pool_seqs,
        args.pool_prompt,
        args.pool_gen,
        args.pool_batch,
        np.random.default_rng(args.seed + 4),
        args.pool_seconds,
        log,
        def_ends=def_ends,
        def_fraction=args.pool_def_fraction,
    )
    report["pool"] = {
        "seqs": int(len(pool)),
        "def_fraction": args.pool_def_fraction,
        "share_of_drafter_batches": args.pool_share,
        "prompt": args.pool_prompt,
        "gen": args.pool_gen,
        "seconds": time.perf_counter() - t_pool,
    }
    pool_wins = list(pool[-64:])  # the last rows: a sample for on-policy agreement metrics, never trained on
    pool_train = pool[:-64] if len(pool) > 128 else pool
    dseq = pool.shape[1] - 1

    # ---- draft
    if args.draft_init == "target":
        draft, draft_shape = draft_from_target(target, target_shape, args.draft_layers)
    else:
        draft = llama.Model(llama_args(vocab, draft_shape))
    mx.eval(draft.parameters())
    report["draft_init"] = {"from": args.draft_init, "layers": draft_shape["num_hidden_layers"]}
    if args.draft_init == "target":  # what the early exit agrees on before distillation, for the report
        report["draft_init"]["on_policy_sample"] = lm_metrics(draft, pool_wins, teacher=target)
        log(f"draft init: on-policy agree {report['draft_init']['on_policy_sample']['top1_agree_target']:.3f}")
    spec = phase_spec("draft")
    rng = np.random.default_rng(args.seed + 2)
    res = train_phase(
        spec,
        dseq,
        draft,
        partial(distill_loss, teacher=target),
        mixed_batches(train_tokens, pool_train, spec.batch, rng, args.pool_share, starts, args.file_start_share),
        [target.state],
        "draft" in compiled,
        log,
    )
    as_shipped(draft)
    save_llama(draft, out / "draft", tok, eos_id)
    report["draft"] = {
        "shape": draft_shape,
        "params": n_params(draft),
        "train": asdict(res),
        "heldout": lm_metrics(draft, held_wins, teacher=target),
        "train_sample": lm_metrics(draft, train_wins, teacher=target),
        "on_policy_sample": lm_metrics(draft, pool_wins, teacher=target),
    }
    log(
        f"draft: held-out CE {report['draft']['heldout']['ce']:.4f}, agree {report['draft']['heldout']['top1_agree_target']:.3f}"
        f", on-policy agree {report['draft']['on_policy_sample']['top1_agree_target']:.3f}"
    )
    _write_report(out, report, log_lines)

    # ---- MTP head
    head = mtp_mod.MTPHead(mtp_mod.head_config_for(target, num_hidden_layers=MTP_LAYERS), target)
    mx.eval(head.parameters())
    spec = phase_spec("mtp")
    rng = np.random.default_rng(args.seed + 3)
    res = train_phase(
        spec,
        dseq,
        head,
        partial(mtp_loss, target=target, depth=args.mtp_depth),
        mixed_batches(train_tokens, pool_train, spec.batch, rng, args.pool_share, starts, args.file_start_share),
        [target.state],
        "mtp" in compiled,
        log,
    )
    as_shipped(head)
    mtp_mod.save_mtp(head, out / "mtp")
    report["mtp"] = {
        "layers": MTP_LAYERS,
        "depth_trained": args.mtp_depth,
        "params": n_params(head),
        "train": asdict(res),
        "heldout": mtp_metrics(head, target, held_wins, args.mtp_depth),
        "train_sample": mtp_metrics(head, target, train_wins, args.mtp_depth),
        "on_policy_sample": mtp_metrics(head, target, pool_wins, args.mtp_depth),
    }
    log(
        f"mtp: held-out agree by depth {[round(x, 3) for x in report['mtp']['heldout']['top1_agree_target']]}"
        f", on-policy {[round(x, 3) for x in report['mtp']['on_policy_sample']['top1_agree_target']]}"
    )

    # ---- round trip through the loaders the daemon uses
    from mlx_lm import load as mlx_lm_load

    t_loaded, tokenizer = mlx_lm_load(str(out / "target"))
    mtp_mod.load_mtp(out / "mtp", t_loaded)
    sample_ids = tokenizer.encode("def fibonacci(n):\n")
    report["roundtrip"] = {"eos_token_ids": sorted(tokenizer.eos_token_ids), "sample_prompt_tokens": len(sample_ids)}
    report["seconds_total"] = time.perf_counter() - t_start
    log(f"done in {report['seconds_total']:.0f}s")
    _write_report(out, report, log_lines)
    return report


def _write_report(out: Path, report: dict, log_lines: list[str]) -> None:
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "train.log").write_text("\n".join(log_lines) + "\n")


if __name__ == "__main__":
    main()
