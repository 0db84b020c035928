"""What the demo models are trained and measured on: next-token and distillation cross-entropy, the
MTP head's chained loss (trained as it drafts), and the held-out metrics.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from workers.models import mtp as mtp_mod


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
