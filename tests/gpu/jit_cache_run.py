"""One process of ``test_jit_cache_gpu``: a 4-bit Llama synth's greedy tokens through the project's
kernels (``qmv_rows`` at 2-8 rows, ``w4a16`` at 32, MLX's own at 1), and the kernel cache's files.

``python -m tests.gpu.jit_cache_run MODEL OUT.json``; ``MLX_PTX_CACHE_DIR`` names the cache.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mlx_lm import load

from tests.helpers.fastpath import greedy_tokens
from workers.engine.engine import Engine
from workers.kernels import fastpath


def main(model_dir: str, out: str) -> None:
    fastpath.set_active(fastpath.CUDA)
    model = load(model_dir)[0]
    shapes = {shape for _, shape in fastpath._projections(model)}
    plans = {
        sh: {r: (-1 if r <= 8 else r) for r in range(2, 17)} | dict.fromkeys(fastpath.LARGE_ROWS, fastpath.MMA)
        for sh in shapes
    }
    fastpath.install(model, plans)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    tokens = {}
    for batch in (1, 6, 32):
        prompts = [[(7 * i + j) % 200 + 1 for j in range(8)] for i in range(batch)]
        engine = Engine(model, eos_token_ids=(), vocab_size=vocab, max_batch=32)
        tokens[batch] = greedy_tokens(engine, prompts, 8)
    cache = Path(os.environ["MLX_PTX_CACHE_DIR"])
    files = sorted(p.name for p in cache.rglob("custom_kernel_mlx_batchd_*.ptx"))
    Path(out).write_text(json.dumps({"tokens": tokens, "files": files}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
