"""The shipped MTP head's config is fingerprinted against its target, and its weights do not copy the
target's embedding (the committed files under ``workers/models/demo/weights``, read without building a model)."""

from __future__ import annotations

import json

import mlx.core as mx

from workers.models.demo import SHIPPED

WEIGHTS = SHIPPED


def test_mtp_config_is_fingerprinted():
    cfg = json.loads((WEIGHTS / "mtp" / "config.json").read_text())
    assert cfg["model_type"] == "mlx_batchd_mtp"
    assert set(cfg["target"]) >= {"hidden_size", "vocab_size", "config_sha256", "embed_sha256"}
    names = set(mx.load(str(WEIGHTS / "mtp" / "model.safetensors")))
    assert not any("embed" in n and "norm" not in n for n in names), "the head must not copy the embedding"
