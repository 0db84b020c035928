"""``mlx-batchd convert`` and ``serve --model FILE.gguf`` on files that cannot be served: one line on
stderr naming the problem, exit 2, and nothing left behind (no output folder, no partial folder,
nothing in the cache). And ``convert`` on a good file writes a folder mlx-lm loads."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from scheduler.cli import main
from tests.helpers.gguf_files import bpe_vocab, write_family, write_minimal


def _truncated(path: Path) -> Path:
    write_family(path.with_suffix(".whole"), "llama")
    data = path.with_suffix(".whole").read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


def _garbage_header(path: Path) -> Path:
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 64)
    return path


def _not_gguf(path: Path) -> Path:
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    return path


BAD: dict[str, tuple[Callable[[Path], Path], str]] = {
    "truncated": (_truncated, "extends past the end of the file"),
    "corrupt-header": (_garbage_header, "corrupt header"),
    "not-gguf": (_not_gguf, "not a GGUF file"),
    "unknown-arch": (lambda p: write_minimal(p, arch="mamba"), "architecture 'mamba' is not supported"),
    "no-tokenizer": (lambda p: write_minimal(p, tokenizer=False), "no tokenizer"),
    "k-quant-type": (lambda p: write_minimal(p, tensor_type="Q5_K"), "tensor type Q5_K"),
}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.parametrize("case", list(BAD))
def test_convert_refuses_in_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make, says = BAD[case]
    bad = make(tmp_path / "bad.gguf")
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    code = main(["convert", str(bad), "--out", str(out_parent / "model")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("mlx-batchd convert: ") and says in err, err
    assert _leftovers(out_parent) == []


@pytest.mark.parametrize("case", ["truncated", "unknown-arch"])
def test_serve_refuses_in_one_line_and_caches_nothing(case: str, tmp_path: Path) -> None:
    """Through the real command line: the daemon never binds, the cache holds nothing."""
    make, says = BAD[case]
    bad = make(tmp_path / "bad.gguf")
    cache = tmp_path / "cache"
    env = {**os.environ, "MLX_BATCHD_CACHE": str(cache)}
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler", "serve", "--model", str(bad), "--listen", f"ipc://{tmp_path / 's.sock'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlx-batchd serve: ") and says in lines[0], proc.stderr
    assert _leftovers(cache) == []
    assert not (tmp_path / "s.sock").exists()


def test_convert_writes_a_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mlx_lm import load

    write_family(tmp_path / "m.gguf", "qwen2")
    out = tmp_path / "empty"
    out.mkdir()  # an empty folder is taken
    assert main(["convert", str(tmp_path / "m.gguf"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"{out} (qwen2, 8-bit")
    model, tokenizer = load(str(out))
    assert tokenizer.decode(tokenizer.encode("in the tree 42")) == "in the tree 42"
    # A folder that is not empty is refused, and left alone.
    assert main(["convert", str(tmp_path / "m.gguf"), "--out", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (out / "config.json").is_file()


def test_convert_finds_an_ollama_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ollama:NAME[:TAG]`` reads Ollama's store layout: manifest -> model layer -> blob."""
    import json

    store = tmp_path / "ollama"
    blob = store / "blobs" / ("sha256-" + "ab" * 32)
    blob.parent.mkdir(parents=True)
    write_family(blob, "qwen3")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8"
    manifest.parent.mkdir(parents=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + "ab" * 32},
    ]
    manifest.write_text(json.dumps({"layers": layers}))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    assert main(["convert", "ollama:tiny:q8", "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    assert main(["convert", "ollama:tiny", "--out", str(tmp_path / "out2")]) == 2  # no "latest" tag pulled
    assert not (tmp_path / "out2").exists()


def test_a_tensor_with_no_place_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tensor the family's mlx-lm model has no parameter for (here qwen3's q_norm in a llama file)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    tokens, types, merges = bpe_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["convert", str(tmp_path / "odd.gguf"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        err == "mlx-batchd convert: odd.gguf: tensor 'blk.0.attn_q_norm.weight' has no place in an mlx-lm llama model\n"
    )
    assert not (tmp_path / "out").exists()
