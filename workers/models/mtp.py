"""A DeepSeek-V3-style multi-token-prediction (MTP) head for an mlx-lm target model.

Why a head and not a second model: the head reuses what the target already computed. Given the
target's last hidden state ``h_t`` (the output of its transformer stack, ``target.model(inputs, cache)``
in mlx-lm's llama) and the embedding of the next token ``x_{t+1}``, it predicts ``x_{t+2}``::

    x = Linear_{2d -> d}([RMSNorm(h_t); RMSNorm(Emb(x_{t+1}))])
    x = TransformerBlock(x)            # one or more blocks, with the head's own KV cache
    logits = LMHead(RMSNorm(x))        # the target's output head, shared

The embedding table and the output head are the target's own arrays (shared, never copied), so the
checkpoint holds only the head's weights, and a head is only valid for the exact target it was trained
on: the config records a fingerprint of that target, and :func:`load_mtp` refuses any other.

Drafting K > 1 tokens chains the head: its output hidden state (before the final norm) takes the place
of ``h`` and the drafted token's embedding that of ``Emb(x_{t+1})``.

Checkpoint format (a directory):

- ``config.json``: ``{"model_type": "mlx_batchd_mtp", "hidden_size", "vocab_size", "num_hidden_layers",
  "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps", "rope_theta",
  "max_position_embeddings", "target": {"model_type", "hidden_size", "vocab_size", "num_hidden_layers",
  "config_sha256", "embed_sha256"}}``. ``config_sha256`` is the SHA-256 of the target's architecture
  arguments (canonical JSON of :func:`target_arch`); ``embed_sha256`` that of its embedding table's raw
  bytes, which pins the trained weights and not only the shape.
- ``model.safetensors``: only the head's own parameters: ``hidden_norm.weight``, ``embed_norm.weight``,
  ``proj.weight`` (``[d, 2d]``), ``layers.N.*`` (mlx-lm llama ``TransformerBlock`` names) and
  ``norm.weight``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.llama import ModelArgs, TransformerBlock

MODEL_TYPE = "mlx_batchd_mtp"

# Architecture arguments of the target that the fingerprint covers. Only plain values: they are what
# decides whether the head's inputs (hidden states, embeddings) mean what they meant in training.
_ARCH_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_traditional",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class TargetFingerprint:
    """What identifies the target a head belongs to (see the module docstring)."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    config_sha256: str
    embed_sha256: str


@dataclass(frozen=True)
class MTPConfig:
    """Shape of the head; its block uses the llama layout so mlx-lm's ``TransformerBlock`` runs it."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    target: TargetFingerprint
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    model_type: str = MODEL_TYPE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MTPConfig:
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(f"not an MTP head config: model_type={d.get('model_type')!r}, want {MODEL_TYPE!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(d) - {"num_hidden_layers", "rms_norm_eps", "rope_theta", "max_position_embeddings"}
        if missing:
            raise ValueError(f"MTP config lacks {sorted(missing)}")
        kw = {k: v for k, v in d.items() if k in names}
        kw["target"] = TargetFingerprint(**d["target"])
        return cls(**kw)

    def block_args(self) -> ModelArgs:
        """The llama ``ModelArgs`` the head's transformer blocks are built from."""
        return ModelArgs(
            model_type="llama",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
        )


@dataclass(frozen=True)
class _TargetRef:
    """Holds the target's shared embedding and output head.

    A plain object on purpose: ``mlx.nn.Module`` treats dict/list/Module attributes as children, so
    storing the target module itself would put its weights into the head's parameter tree (and into
    its checkpoint and optimizer). A frozen dataclass stays outside that tree.
    """

    embed: Callable[[mx.array], mx.array]
    lm_head: Callable[[mx.array], mx.array]


def target_embedding(target: nn.Module) -> nn.Module:
    """The target's input embedding module (mlx-lm layout: ``target.model.embed_tokens``)."""
    return target.model.embed_tokens


def target_lm_head(target: nn.Module) -> Callable[[mx.array], mx.array]:
    """The target's output head: ``lm_head`` if it has one, else the tied embedding used as a linear."""
    if "lm_head" in target:
        return target.lm_head
    return target_embedding(target).as_linear


def target_forward(target: nn.Module, inputs: mx.array, cache: list | None = None) -> tuple[mx.array, mx.array]:
    """Run the target and return ``(logits, hidden)``, the hidden state being what the head consumes."""
    hidden = target.model(inputs, cache=cache)
    return target_lm_head(target)(hidden), hidden


def target_arch(target: nn.Module) -> dict[str, Any]:
    """The target's architecture arguments covered by the fingerprint, as plain JSON values."""
    args = target.args
    d = dict(vars(args))
    return {k: d.get(k) for k in _ARCH_FIELDS}


def _array_sha256(a: mx.array) -> str:
    """SHA-256 of an array's raw bytes (bf16 included, which numpy cannot hold as such)."""
    raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return hashlib.sha256(np.ascontiguousarray(np.array(raw)).tobytes()).hexdigest()


def fingerprint(target: nn.Module) -> TargetFingerprint:
    """Compute the fingerprint of a loaded mlx-lm target (see the module docstring)."""
    arch = target_arch(target)
    config_sha = hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()
    emb = target_embedding(target)
    return TargetFingerprint(
        model_type=str(arch["model_type"]),
        hidden_size=int(arch["hidden_size"]),
        vocab_size=int(arch["vocab_size"]),
        num_hidden_layers=int(arch["num_hidden_layers"]),
        config_sha256=config_sha,
        embed_sha256=_array_sha256(emb.weight),
    )


class MTPHead(nn.Module):
    """The head itself. Call it on target hidden states and next-token ids; chain it with :meth:`draft`."""

    def __init__(self, config: MTPConfig, target: nn.Module):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.hidden_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.embed_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        args = config.block_args()
        self.layers = [TransformerBlock(args) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self._target = _TargetRef(embed=target_embedding(target), lm_head=target_lm_head(target))

    def make_cache(self) -> list[KVCache]:
        """A fresh KV cache for the head's blocks (one per block), separate from the target's."""
        return [KVCache() for _ in self.layers]

    def fuse_inputs(self, hidden: mx.array, token_ids: mx.array) -> mx.array:
        """``Linear([RMSNorm(hidden); RMSNorm(Emb(token_ids))])``: the block input, ``[B, L, d]``."""
        emb = self._target.embed(token_ids)
        return self.proj(mx.concatenate([self.hidden_norm(hidden), self.embed_norm(emb)], axis=-1))

    def logits(self, hidden_out: mx.array) -> mx.array:
        """Final norm, then the target's output head."""
        return self._target.lm_head(self.norm(hidden_out))

    def __call__(
        self, hidden: mx.array, token_ids: mx.array, cache: list[KVCache] | None = None
    ) -> tuple[mx.array, mx.array]:
        """Predict the token two places after each input position.

        ``hidden[:, i]`` is the target's hidden state at position ``p + i`` and ``token_ids[:, i]`` the
        token at position ``p + i + 1`` (``p`` = ``cache[0].offset``). Returns ``(logits, hidden_out)``:
        ``logits[:, i]`` scores the token at ``p + i + 2``; ``hidden_out`` (pre-norm) is what a chained
        step feeds back in place of ``hidden``.
        """
        x = self.fuse_inputs(hidden, token_ids)
        caches: list[Any] = list(cache) if cache is not None else [None] * len(self.layers)
        mask = create_attention_mask(x, caches[0])
        for layer, c in zip(self.layers, caches):
            x = layer(x, mask, cache=c)
        return self.logits(x), x

    def draft(self, hidden: mx.array, token_ids: mx.array, cache: list[KVCache], k: int) -> mx.array:
        """Greedily draft ``k`` tokens; returns them as ``[B, k]`` int32.

        Cache protocol (why the call takes blocks): the head's cache must only ever hold entries built
        from true target hidden states. Pass every position not yet in the cache: after a verify round
        that accepted ``a`` drafts, that is the ``a + 1`` hidden states the verify block produced for the
        committed tokens, with the tokens that follow each (the accepted drafts and the bonus token).
        The first output drafts token one, then the head is chained ``k - 1`` times on its own hidden
        state; those ``k - 1`` chained entries are speculative, so the caller trims them
        (:func:`trim_cache` with ``k - 1``) before the next call.
        """
        logits, h = self(hidden, token_ids, cache)
        tok = mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)
        out = [tok]
        h = h[:, -1:, :]
        for _ in range(k - 1):
            logits, h = self(h, tok, cache)
            tok = mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)
            out.append(tok)
        return mx.concatenate(out, axis=1)


def trim_cache(cache: list[KVCache], n: int) -> None:
    """Drop the last ``n`` entries of every block's cache (speculative entries after a round)."""
    for c in cache:
        c.trim(n)


def head_config_for(
    target: nn.Module,
    num_hidden_layers: int = 1,
    intermediate_size: int | None = None,
) -> MTPConfig:
    """An :class:`MTPConfig` shaped like one of the target's own blocks, fingerprinted to the target."""
    a = target.args
    return MTPConfig(
        hidden_size=a.hidden_size,
        vocab_size=a.vocab_size,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads or a.num_attention_heads,
        intermediate_size=intermediate_size or a.intermediate_size,
        num_hidden_layers=num_hidden_layers,
        rms_norm_eps=a.rms_norm_eps,
        rope_theta=float(a.rope_theta),
        max_position_embeddings=int(getattr(a, "max_position_embeddings", None) or 2048),
        target=fingerprint(target),
    )


def save_mtp(head: MTPHead, path: str | Path, dtype: mx.Dtype | None = mx.bfloat16) -> None:
    """Write ``config.json`` and ``model.safetensors`` (the head's own weights only)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(head.parameters()))
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")


def check_fingerprint(config: MTPConfig, target: nn.Module, check_weights: bool = True) -> None:
    """Raise ``ValueError`` naming every field where ``target`` is not the head's target."""
    want = config.target
    got = fingerprint(target)
    fields = ["model_type", "hidden_size", "vocab_size", "num_hidden_layers", "config_sha256"]
    if check_weights:
        fields.append("embed_sha256")
    diffs = [
        f"{f}: head expects {getattr(want, f)!r}, target has {getattr(got, f)!r}"
        for f in fields
        if getattr(want, f) != getattr(got, f)
    ]
    if diffs:
        raise ValueError("MTP head does not belong to this target model:\n  " + "\n  ".join(diffs))


def load_mtp(path: str | Path, target_model: nn.Module, check_weights: bool = True) -> MTPHead:
    """Load an MTP head for ``target_model``; ``ValueError`` if it was trained for another target.

    ``check_weights=False`` skips the embedding hash (for a very large target where hashing the table
    costs too much); the architecture hash is always checked, and so are all weight names and shapes.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"no MTP head at {path}: config.json missing")
    config = MTPConfig.from_dict(json.loads(cfg_file.read_text()))
    check_fingerprint(config, target_model, check_weights=check_weights)
    head = MTPHead(config, target_model)
    weights = cast(dict[str, mx.array], mx.load(str(path / "model.safetensors")))
    expected = {k: v.shape for k, v in cast(list[tuple[str, mx.array]], tree_flatten(head.parameters()))}
    got = {k: v.shape for k, v in weights.items()}
    if expected.keys() != got.keys():
        raise ValueError(
            f"MTP weights at {path} do not match the config: missing {sorted(expected.keys() - got.keys())}, "
            f"unexpected {sorted(got.keys() - expected.keys())}"
        )
    bad = [f"{k}: {got[k]} != {expected[k]}" for k in expected if tuple(got[k]) != tuple(expected[k])]
    if bad:
        raise ValueError(f"MTP weight shapes at {path} do not match the config: {bad}")
    head.load_weights(list(weights.items()))
    head.eval()
    mx.eval(head.parameters())
    return head
