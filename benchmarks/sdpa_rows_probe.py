"""Device measurement: a verify block's attention in one launch (``workers/kernels/sdpa_rows.py``) against
MLX's one-query calls, as classic decode makes them (issue 14).

    python benchmarks/sdpa_rows_probe.py --out sdpa.json

For key counts around the kernels' edges (one pass up to 1,024 keys, two beyond; cuDNN at multiples
of 256) and an 8B llama's attention shape (32 query heads, 8 KV heads, head dimension 128, bfloat16),
a block of ``--queries`` queries whose last one sees ``keys`` keys: for each query, whether the kernel's
output is byte-equal to MLX's one-query call over its own keys (contiguous, as decode calls it), the
milliseconds of the one launch against the per-query calls (median of ``REPS``), and the group width
and way ``workers.kernels.attention`` measures for the shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from workers.api import CUDNN_ATTENTION_DEFAULT
from workers.kernels import attention, fastpath, sdpa_rows
from workers.kernels.backend import configure_attention

KEYS = (10, 255, 300, 515, 1023, 1030, 2000, 4099, 8195)
REPS = 20


def _ms(f: Any) -> float:
    mx.eval(f())
    samples = []
    for _ in range(REPS):
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(f())
        samples.append(1e3 * (time.perf_counter() - tic))
    return round(statistics.median(samples), 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--queries", type=int, default=5)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    a = ap.parse_args()
    fastpath.set_active(fastpath.detect())
    configure_attention(CUDNN_ATTENTION_DEFAULT)  # as the engine runs: MLX's one-query calls as decode makes them
    n, scale, dt = a.queries, a.dim**-0.5, mx.bfloat16
    report: dict[str, Any] = {"device": str(mx.default_device()), "queries": n, "by_keys": {}}
    for total in KEYS:
        q = mx.random.normal((1, a.heads, n, a.dim), key=mx.random.key(total)).astype(dt)
        # Views of a buffer with room, as the cache hands them to attention.
        room = (total // 256 + 1) * 256
        k = mx.random.normal((1, a.kv_heads, room, a.dim), key=mx.random.key(total + 1)).astype(dt)
        v = mx.random.normal((1, a.kv_heads, room, a.dim), key=mx.random.key(total + 2)).astype(dt)
        mx.eval(q, k, v)
        k, v = k[:, :, :total], v[:, :, :total]
        lengths = [total - n + 1 + i for i in range(n)]

        def one_query_calls(
            q: mx.array = q, k: mx.array = k, v: mx.array = v, lengths: list[int] = lengths
        ) -> list[mx.array]:
            return [
                scaled_dot_product_attention(
                    q[:, :, i : i + 1],
                    *fastpath.attention_inputs(k[:, :, :end], v[:, :, :end]),
                    None,
                    scale=scale,
                    mask=None,
                )
                for i, end in enumerate(lengths)
            ]

        row: dict[str, Any] = {"lengths": lengths, "one_query_ms": _ms(one_query_calls)}
        if sdpa_rows.takes(q, k, v):
            try:
                out = sdpa_rows.attend(q, k, v, scale)
                want = one_query_calls()
                mx.eval(out, want)
                row["equal"] = [
                    bool(mx.array_equal(out[:, :, i : i + 1].view(mx.uint8), w.view(mx.uint8)).item())
                    for i, w in enumerate(want)
                ]
                row["kernel_ms"] = _ms(lambda q=q, k=k, v=v: sdpa_rows.attend(q, k, v, scale))
            except Exception as exc:  # a measurement: record what failed and go on
                row["error"] = repr(exc)
        else:
            row["error"] = "the kernel does not take these shapes here"
        report["by_keys"][total] = row
        print(total, json.dumps(row), flush=True)
    width, kernel = attention.group_width(scaled_dot_product_attention, q, k, scale)
    report["group_width"] = {"width": width, "kernel": kernel}
    print("group width", width, "kernel" if kernel else "MLX calls", flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
