"""``workers.dist`` on a real 2-rank ring group on this machine's CPU: what two ranks compute.

Tensor-parallel greedy decoding reproducible run to run and equal to one process, a pipeline split
the same bytes as one process, and the daemon's ``Engine`` driven in lockstep serving what one process
does. The ranks run ``tests.helpers.rank_program`` (see ``tests.helpers.distributed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers.distributed import MAX_TOKENS, PROMPTS, launch, single
from tests.helpers.distributed import models as models
from tests.helpers.distributed import ring as ring
from tests.helpers.rank_program import ODD_VALUES


def test_tensor_parallel_greedy_is_reproducible_and_matches_one_process(
    ring: None, models: dict[str, str], tmp_path: Path
) -> None:
    import numpy as np

    spec = {"model": models["a"], "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
    alone = single("greedy", tmp_path / "single", **spec)
    first, output = launch("greedy", tmp_path / "tp1", **spec)
    second, _ = launch("greedy", tmp_path / "tp2", **spec)
    assert alone["mode"] == "none"
    for run in (first, second):
        assert not any("error" in r for r in run), f"{[r.get('error') for r in run]}\n{output}"
        assert [r["mode"] for r in run] == ["tensor", "tensor"]
        assert [r["world"]["world_size"] for r in run] == [2, 2]
        # Followers decoded prompts they only ever saw in a plan, to the same bytes as rank 0.
        assert run[1]["tokens"] == run[0]["tokens"]
        assert run[1]["logprobs_sha256"] == run[0]["logprobs_sha256"]
        assert run[1]["plans"] == run[0]["plans"]
        assert run[1]["odd"] == run[0]["odd"] == [repr(v) for v in ODD_VALUES]
    assert first[0]["fingerprint"] == first[1]["fingerprint"] == second[0]["fingerprint"]
    # Two TP = 2 runs: the same logprob bytes, not only the same tokens.
    assert second[0]["logprobs_sha256"] == first[0]["logprobs_sha256"]
    assert [len(t) for t in first[0]["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    # TP = 2 against one process: the split sums round differently, so the logprobs may differ in
    # the last bits (float32 here); the greedy tokens must not.
    assert first[0]["tokens"] == alone["tokens"]
    tp = np.load(tmp_path / "tp1" / "out" / "logprobs.npy")
    one = np.load(tmp_path / "single" / "out" / "logprobs.npy")
    diff = float(np.abs(tp - one).max())
    print(
        f"TP=2 vs 1 process: tokens equal; logprob bytes equal: {tp.tobytes() == one.tobytes()}; max |diff| {diff:.3g}"
    )
    assert diff < 1e-4


def test_a_pipeline_split_decodes_the_same_bytes_as_one_process(ring: None, tmp_path: Path) -> None:
    """qwen2 has both splits; by layers, each rank's sums are whole, so nothing rounds differently."""
    from workers.models.synthetic import qwen3_config, write_model

    config = {**qwen3_config(hidden=128, layers=4, dtype="float32"), "model_type": "qwen2"}
    model = str(write_model(tmp_path / "qwen2", config, seed=3))
    spec: dict[str, Any] = {"model": model, "prompts": PROMPTS[:2], "max_tokens": MAX_TOKENS, "mode": "pipeline"}
    alone = single("greedy", tmp_path / "single", **spec)
    run, output = launch("greedy", tmp_path / "pp", **spec)
    assert not any("error" in r for r in run), f"{[r.get('error') for r in run]}\n{output}"
    assert [r["mode"] for r in run] == ["pipeline", "pipeline"]
    assert run[0]["tokens"] == run[1]["tokens"] == alone["tokens"]
    assert run[0]["logprobs_sha256"] == run[1]["logprobs_sha256"] == alone["logprobs_sha256"]


def test_the_engine_in_lockstep_serves_what_one_process_does(
    ring: None, models: dict[str, str], tmp_path: Path
) -> None:
    from workers.models.synthetic import BYTE_VOCAB

    spec = {"model": models["a"], "vocab": BYTE_VOCAB}
    alone = single("engine", tmp_path / "single", **spec)
    run, output = launch("engine", tmp_path / "tp", **spec)
    assert not any("error" in r for r in run), f"{[r.get('error') for r in run]}\n{output}"
    assert [r["mode"] for r in run] == ["tensor", "tensor"]
    assert run[0]["iterations"] == run[1]["iterations"] == alone["iterations"]
    assert run[0]["tokens"] == run[1]["tokens"] == alone["tokens"]
    assert len(alone["tokens"]) == 4 and len(alone["tokens"]["1"]) < MAX_TOKENS  # seq 1 was cancelled
