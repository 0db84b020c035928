"""The shipped demo models load offline from the repository and decode (CPU, a few seconds).

Why: ``--model demo`` / ``--draft demo`` / ``--mtp demo`` must work on a fresh machine with no network,
so these tests load exactly the committed artifacts under ``workers/models/demo/weights``.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models import llama

from workers.models import mtp
from workers.models.demo import SHIPPED

WEIGHTS = SHIPPED
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def target():
    return load(str(WEIGHTS / "target"))


@pytest.fixture(scope="module")
def draft():
    return load(str(WEIGHTS / "draft"))


@pytest.fixture(scope="module")
def head(target):
    return mtp.load_mtp(WEIGHTS / "mtp", target[0])


def _greedy_tokens(model, tokenizer, n: int) -> list[int]:
    prompt = mx.array(tokenizer.encode(PROMPT))
    return [int(tok) for tok, _ in generate_step(prompt, model, max_tokens=n)]


def test_target_decodes_text(target):
    model, tokenizer = target
    assert tokenizer.eos_token == "<|endoftext|>"
    assert model.args.vocab_size == len(tokenizer.vocab)
    toks = _greedy_tokens(model, tokenizer, 8)
    assert len(toks) == 8 and all(0 <= t < model.args.vocab_size for t in toks)
    assert isinstance(tokenizer.decode(toks), str)


def test_chat_template_renders(target):
    _, tokenizer = target
    text = tokenizer.apply_chat_template([{"role": "user", "content": "add two numbers"}], tokenize=False)
    assert text == "# user: add two numbers\n"


def test_draft_shares_the_tokenizer(target, draft):
    model, tokenizer = draft
    assert (WEIGHTS / "draft" / "tokenizer.json").read_bytes() == (WEIGHTS / "target" / "tokenizer.json").read_bytes()
    assert model.args.vocab_size == target[0].args.vocab_size
    assert len(_greedy_tokens(model, tokenizer, 8)) == 8


def test_mtp_head_predicts_from_target_hidden(target, head):
    model, tokenizer = target
    ids = mx.array([tokenizer.encode(PROMPT)])
    logits, hidden = mtp.target_forward(model, ids)
    assert hidden.shape == (1, ids.shape[1], model.args.hidden_size)
    nxt = mx.argmax(logits[:, -1:], axis=-1)
    # Pair each hidden state with the token after it: the prompt's own tokens, then the next one.
    tokens = mx.concatenate([ids[:, 1:], nxt], axis=1)
    cache = head.make_cache()
    out, h_out = head(hidden, tokens, cache)
    assert out.shape == (1, ids.shape[1], model.args.vocab_size)
    assert h_out.shape == hidden.shape
    assert mx.all(mx.isfinite(out.astype(mx.float32))).item()
    drafted = head.draft(hidden[:, -1:], nxt, head.make_cache(), k=3)
    assert drafted.shape == (1, 3)
    assert all(0 <= t < model.args.vocab_size for t in drafted[0].tolist())


def test_mtp_refuses_another_target(target, draft):
    # The draft model is the target's early exit: same width, fewer blocks (and its own fine-tuned weights).
    with pytest.raises(ValueError, match="num_hidden_layers"):
        mtp.load_mtp(WEIGHTS / "mtp", draft[0])
    # Same architecture, different weights: only the embedding hash tells them apart.
    args = llama.ModelArgs.from_dict(json.loads((WEIGHTS / "target" / "config.json").read_text()))
    mx.random.seed(1)
    impostor = llama.Model(args)
    impostor.set_dtype(mx.bfloat16)
    with pytest.raises(ValueError, match="embed_sha256"):
        mtp.load_mtp(WEIGHTS / "mtp", impostor)
    mtp.load_mtp(WEIGHTS / "mtp", impostor, check_weights=False)  # shapes still match
