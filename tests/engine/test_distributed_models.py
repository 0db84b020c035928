"""``workers.dist`` on models in one process: sharding refused in one line before any
collective, and weight fingerprints that tell checkpoints apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.distributed import models as models


def test_sharding_is_refused_in_one_line_before_any_collective() -> None:
    from workers.dist import ShardError, plan_sharding
    from workers.models.synthetic import build_model, gemma3_config, llama_config, qwen3_config

    llama = llama_config(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, dtype="float32")
    model = build_model(llama)
    assert plan_sharding(model, llama, 1) == "none"
    assert plan_sharding(model, llama, 2) == "tensor"
    with pytest.raises(ShardError, match=r"num_attention_heads=4 is not divisible by the world size 3"):
        plan_sharding(model, llama, 3)
    with pytest.raises(ShardError, match=r"'llama'.*no pipeline\(\)"):
        plan_sharding(model, llama, 2, "pipeline")
    gemma = gemma3_config(hidden=64, layers=2)
    with pytest.raises(
        ShardError, match=r"model_type 'gemma3_text'.*neither a tensor-parallel shard\(\) nor a pipeline"
    ):
        plan_sharding(build_model(gemma), gemma, 2)
    # qwen2 has both: heads that do not divide fall back to the pipeline, which needs a layer per rank.
    qwen2 = {**qwen3_config(hidden=96, layers=2, dtype="float32"), "model_type": "qwen2", "num_attention_heads": 3}
    qwen2.update(num_key_value_heads=3, head_dim=32)
    q = build_model(qwen2)
    assert plan_sharding(q, qwen2, 2) == "pipeline"
    with pytest.raises(ShardError, match=r"tensor parallel: num_attention_heads=3.*pipeline: 2 layers cannot"):
        plan_sharding(q, qwen2, 4)


def test_fingerprints_tell_different_weights_apart(tmp_path: Path, models: dict[str, str]) -> None:
    from mlx_lm import load

    from workers.dist import checkpoint_fingerprint, weight_fingerprint

    a, b = load(models["a"])[0], load(models["b"])[0]
    assert weight_fingerprint(a) == weight_fingerprint(load(models["a"])[0])
    assert weight_fingerprint(a) != weight_fingerprint(b)
    assert checkpoint_fingerprint(models["a"]) == checkpoint_fingerprint(models["a"])
    assert checkpoint_fingerprint(models["a"]) != checkpoint_fingerprint(models["b"])
