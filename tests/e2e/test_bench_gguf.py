"""``mlx-batchd bench --model FILE.gguf`` and ``--prompts rewrite``: the command line takes a GGUF
file as the model spec and resolves it as ``serve`` does, a missing file is one line, and the
rewrite/copy prompt set is the chats rendered with the served model's own chat template (a model
without one is refused in one line before any daemon starts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scheduler.bench.output import BenchError
from scheduler.bench.rewrite import CODE_FILE, DOCUMENT, REWRITE_CHATS, rewrite_prompts
from scheduler.cli import build_parser, main
from workers.models.loading import check_model, load_tokenizer

SMALL = ["--batch-sizes", "1", "--tokens", "4", "--repeats", "1"]


def test_bench_takes_a_gguf_file_as_its_model(smollm2_gguf: Path) -> None:
    """The spec the bench loads and hands its daemons resolves to the converted model folder."""
    args = build_parser().parse_args(["bench", "--model", str(smollm2_gguf), "--prompts", "rewrite", *SMALL])
    assert args.model == str(smollm2_gguf) and args.prompts == "rewrite"
    folder = check_model(args.model)
    assert (folder / "gguf_source.json").is_file() and any(folder.glob("model*.safetensors"))
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"


def test_bench_on_a_missing_gguf_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.gguf"
    code = main(["bench", "--model", str(missing), "--out", str(tmp_path / "out"), *SMALL])
    err = capsys.readouterr().err
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("mlx-batchd bench: ") and "no such file" in err, err
    assert not (tmp_path / "out").exists()


def test_rewrite_prompts_are_the_chats_in_the_models_template(smollm2_gguf: Path) -> None:
    tokenizer = load_tokenizer(str(smollm2_gguf))
    prompts = rewrite_prompts(tokenizer, 3, seed=1)
    rendered = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in REWRITE_CHATS]
    assert prompts == [list(rendered[1]), list(rendered[0]), list(rendered[1])]  # from chat `seed`, cycling
    code, summary = tokenizer.decode(prompts[1]), tokenizer.decode(prompts[0])
    # SmolLM2's ChatML: the whole file and the whole document are in the prompt, the answer is next.
    assert "<|im_start|>user\nRename the function best_player to top_scorer" in code and CODE_FILE in code
    assert "<|im_start|>user\nSummarise this report" in summary and DOCUMENT in summary
    assert code.endswith("<|im_start|>assistant\n") and summary.endswith("<|im_start|>assistant\n")


def test_rewrite_prompts_refuse_a_model_without_a_chat_template(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model, plain)
    config_path = plain / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(BenchError, match="chat template"):
        rewrite_prompts(load_tokenizer(str(plain)), 1, seed=0)
    # Through the command line: one line, before any daemon starts (so no results folder either).
    code = main(["bench", "--model", str(plain), "--prompts", "rewrite", "--out", str(tmp_path / "out"), *SMALL])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("mlx-batchd bench: ") and "chat template" in err, err
    assert not (tmp_path / "out").exists()
