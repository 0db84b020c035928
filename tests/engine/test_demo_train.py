"""The demo training script on tiny models: the draft initialised as the target's early exit, and a
smoke run of the whole script whose output loads like the shipped set."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from tools.demo import models, train


def _target() -> tuple[llama.Model, dict]:
    shape = dict(hidden_size=32, num_hidden_layers=3, intermediate_size=64, num_attention_heads=2)
    mx.random.seed(3)
    target = llama.Model(models.llama_args(64, shape))
    target.set_dtype(mx.bfloat16)
    mx.eval(target.parameters())
    return target, shape


def test_draft_from_target_is_the_targets_early_exit() -> None:
    target, shape = _target()
    draft, draft_shape = models.draft_from_target(target, shape, layers=2)
    assert draft_shape["num_hidden_layers"] == 2 and len(draft.model.layers) == 2
    tokens = mx.array([[1, 5, 9, 2, 7]])
    # The target's embedding, first two blocks and final norm, then its tied output head, in float32.
    target.set_dtype(mx.float32)
    h = target.model.embed_tokens(tokens)
    mask = nn.MultiHeadAttention.create_additive_causal_mask(tokens.shape[1]).astype(h.dtype)
    for layer in target.model.layers[:2]:
        h = layer(h, mask)
    expected = target.model.embed_tokens.as_linear(target.model.norm(h))
    got = draft(tokens)
    assert got.dtype == mx.float32
    assert mx.allclose(got, expected, atol=1e-5).item()
    # more layers than the target has: the whole target
    _, whole = models.draft_from_target(target, shape, layers=9)
    assert whole["num_hidden_layers"] == 3


def test_training_script_smoke_run_loads_like_the_shipped_set(tmp_path) -> None:
    """The whole script on tiny shapes and a few steps: every phase runs, and what it writes loads
    through the loaders the daemon uses (the draft as an early exit of the target)."""
    from mlx_lm import load

    from workers.models import mtp

    out = tmp_path / "weights"
    steps = ["--target-steps", "3", "--draft-steps", "3", "--mtp-steps", "3"]
    batches = ["--target-batch", "4", "--draft-batch", "4", "--mtp-batch", "4"]
    pool = ["--pool-seqs", "8", "--pool-batch", "8", "--pool-gen", "8", "--pool-prompt", "9"]
    report = train.main(
        ["--smoke", "--max-files", "5", "--out", str(out), "--seq-len", "16", "--eval-windows", "1"]
        + ["--eval-every", "3", "--draft-layers", "1", *steps, *batches, *pool]
    )
    assert report["draft_init"]["from"] == "target" and report["draft"]["shape"]["num_hidden_layers"] == 1
    assert report["pool"]["seqs"] == 8 and report["pool"]["share_of_drafter_batches"] == 0.75
    assert report["vocab_size"] == 257  # byte-level by default: 256 bytes + EOS
    target, tokenizer = load(str(out / "target"))
    text = "def f(x):\n        return 'é日'\n"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode()) and tokenizer.decode(ids) == text  # one token per byte, lossless
    draft, _ = load(str(out / "draft"))
    assert draft.args.hidden_size == target.args.hidden_size
    mtp.load_mtp(out / "mtp", target)
