"""The project's kernels written to MLX's disk cache (``workers.kernels.jit_cache``) on MLX CUDA: MLX
loads the file at the name computed here, and a process served from the cache gives the bytes of one
that compiled every kernel itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from workers.kernels import w4a16
from workers.models.synthetic import llama_config, write_model

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]

#: A kernel with every kind of template argument and an input's shape among its parameters.
TOY = """
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_shape[0]) {
        out[i] = static_cast<T>(static_cast<float>(x[i]) + (FLAG ? ADD : 0));
    }
"""
TOY_SCRIPT = """
import sys, mlx.core as mx
from workers.kernels import jit_cache
source, add = sys.argv[1], int(sys.argv[2])
kernel = jit_cache.cuda_kernel(name="jit_cache_toy", input_names=["x"], output_names=["out"], source=source)
x = mx.arange(64, dtype=mx.bfloat16)
template = [("T", mx.bfloat16), ("ADD", add), ("FLAG", True)]
if sys.argv[3] == "prime":
    print(jit_cache.prime(kernel, [x], template, [mx.bfloat16]))
else:
    (out,) = kernel(inputs=[x], template=template, grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)], output_dtypes=[mx.bfloat16])
    print(int((out - x).astype(mx.int32).max().item()))
"""


def _python(code_or_module: list[str], cache: Path, **env: str) -> str:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    run_env = {**os.environ, "MLX_PTX_CACHE_DIR": str(cache), "PYTHONPATH": path, **env}
    done = subprocess.run(
        [sys.executable, *code_or_module], env=run_env, cwd=ROOT, capture_output=True, text=True, timeout=420
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_mlx_loads_the_module_written_at_the_name_computed_here(tmp_path: Path) -> None:
    """The cache holds, at the toy's module name, the binary of a variant that adds 5 instead of 3: a
    fresh process calling the toy then adds 5, so MLX read that file (kernel text, std::hash and the
    cache folder all reproduced)."""
    cache = tmp_path / "ptx"
    path = Path(_python(["-c", TOY_SCRIPT, TOY, "3", "prime"], cache))
    other = tmp_path / "other"
    written = Path(_python(["-c", TOY_SCRIPT, TOY.replace("ADD :", "(ADD + 2) :"), "3", "prime"], other))
    assert path.exists() and written.exists() and path.name != written.name
    path.write_bytes(written.read_bytes())  # same kernel name, so the names file stays valid
    # MLX_BATCHD_KERNEL_CACHE=0: nothing primed, MLX alone decides what runs
    assert _python(["-c", TOY_SCRIPT, TOY, "3", "call"], cache, MLX_BATCHD_KERNEL_CACHE="0") == "5"
    assert _python(["-c", TOY_SCRIPT, TOY, "3", "call"], tmp_path / "empty", MLX_BATCHD_KERNEL_CACHE="0") == "3"


@pytest.mark.timeout(900)  # three processes, two of which compile every kernel
def test_a_process_served_from_the_cache_gives_the_bytes_of_one_that_compiled_its_kernels(tmp_path: Path) -> None:
    assert mx.cuda.is_available()
    config = llama_config(1024, 4, 2816, 8, 2, quant_bits=4, echo=True)
    model = str(write_model(tmp_path / "m", config, seed=7))
    run = ["-m", "tests.gpu.jit_cache_run", model]
    cache = tmp_path / "ptx"
    _python([*run, str(tmp_path / "a.json")], cache, MLX_BATCHD_W4A16="1")
    first = json.loads((tmp_path / "a.json").read_text())
    assert any(f.startswith("custom_kernel_mlx_batchd_qmv_rows_") for f in first["files"]), first["files"]
    assert any(f.startswith(f"custom_kernel_mlx_batchd_{w4a16.NATIVE.tag}_") for f in first["files"]), first["files"]
    _python([*run, str(tmp_path / "b.json")], cache, MLX_BATCHD_W4A16="1")
    again = json.loads((tmp_path / "b.json").read_text())
    _python([*run, str(tmp_path / "c.json")], tmp_path / "alone", MLX_BATCHD_W4A16="1", MLX_BATCHD_KERNEL_CACHE="0")
    alone = json.loads((tmp_path / "c.json").read_text())
    assert alone["files"] == []  # nothing written with the cache off
    assert again["files"] == first["files"]  # every variant was there: none written again
    assert first["tokens"] == again["tokens"] == alone["tokens"]
