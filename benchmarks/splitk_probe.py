"""The row-exact kernel with each output's K split over a block's warps (``rowkernel.SPLIT_WARPS``),
against MLX's own quantized matmul, the one-warp row-exact kernel and the mirrored kernel, per layer
shape of an 8B-shaped 4-bit llama (run where MLX runs on CUDA).

    python benchmarks/splitk_probe.py --out split.json

Per shape (out, in) and rows M = 1, 4, 8: microseconds a call, as ``--calls`` independent calls
evaluated together (kernel time plus launch, no per-call synchronization) and as one call evaluated
alone (with the synchronization); for the split kernel, per warps a block (W) and outputs a block (R):
the error against the fp32 reference (max abs over max |reference|) and whether each row of an M-row
call is byte-equal to the one-row call on that row. The weight bytes a call reads over the H200's
4.8 TB/s are printed beside, the physical floor.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from workers import qmv_launch, qmv_rows, rowkernel

#: (out, in) of the 8B llama's projections: q/o, k/v, gate/up, down, the head.
SHAPES = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
ROWS = (1, 4, 8)
#: (warps a block, outputs a block) tried.
SPLITS = ((4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (2, 2), (2, 4))
HBM_BYTES_S = 4.8e12


def per_call_us(f: Any, calls: int) -> tuple[float, float]:
    """(us a call when ``calls`` are evaluated together, us of one call evaluated alone): medians of 5."""
    for _ in range(2):
        mx.eval([f() for _ in range(calls)])
    together, alone = [], []
    for _ in range(5):
        outs = [f() for _ in range(calls)]
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        together.append((time.perf_counter() - tic) / calls * 1e6)
        out = f()
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        alone.append((time.perf_counter() - tic) * 1e6)
    together.sort()
    alone.sort()
    return round(together[2], 2), round(alone[2], 2)


def rel_err(got: mx.array, ref: mx.array) -> float:
    g, r = got.astype(mx.float32), ref.astype(mx.float32)
    return round(float((mx.max(mx.abs(g - r)) / mx.max(mx.abs(r))).item()), 6)


def row_exact(module: Any, x: mx.array) -> bool:
    ones = [rowkernel.project(module, x[i : i + 1]) for i in range(x.shape[0])]
    many = rowkernel.project(module, x)
    assert many is not None
    return all(
        bool(mx.array_equal(many[i].view(mx.uint16), one[0].view(mx.uint16)).item())  # type: ignore[index]
        for i, one in enumerate(ones)
    )


def shape_row(out_f: int, in_f: int, calls: int) -> dict[str, Any]:
    lin = nn.QuantizedLinear(in_f, out_f, bias=False, group_size=64, bits=4)
    lin.set_dtype(mx.bfloat16)
    x = (mx.random.normal((8, in_f)) * 0.5).astype(mx.bfloat16)
    mx.eval(lin.parameters(), x)
    weight_bytes = lin.weight.nbytes + lin.scales.nbytes + lin.biases.nbytes  # type: ignore[union-attr]
    row: dict[str, Any] = {"shape": [out_f, in_f], "floor_us": round(weight_bytes / HBM_BYTES_S * 1e6, 2)}
    kind, weights, _, extra = rowkernel._weights(lin)  # type: ignore[misc]
    ref = rowkernel._reference(kind, x, weights, extra)
    row["mlx"] = {m: per_call_us(lambda m=m: lin(x[:m][:, None]), calls) for m in ROWS}
    row["mlx_flat"] = {m: per_call_us(lambda m=m: lin(x[:m]), calls) for m in ROWS}
    found = qmv_rows.covered(lin, x)
    if found is not None and rowkernel.implementation() == "cuda":
        row["mirrored"] = {
            m: per_call_us(lambda m=m: qmv_rows._launch(x[:m], [found[:3]], found[3], found[4])[0], calls) for m in ROWS
        }
    rowkernel.SPLIT_WARPS = 0
    row["rowwise"] = {m: per_call_us(lambda m=m: rowkernel.project(lin, x[:m]), calls) for m in ROWS}
    for w, r in SPLITS:
        rowkernel.SPLIT_WARPS, rowkernel.SPLIT_OUTS, rowkernel.SPLIT_OUTS_DEFAULT = w, {}, r
        got = rowkernel.project(lin, x)
        assert got is not None
        row[f"split_W{w}R{r}"] = {
            "rel_err": rel_err(got, ref),
            "row_exact_8": row_exact(lin, x),
            "us": {m: per_call_us(lambda m=m: rowkernel.project(lin, x[:m]), calls) for m in ROWS},
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes only")
    args = ap.parse_args()
    mx.random.seed(0)
    print(f"mirrored kernel: {qmv_launch.variant()}; rowkernel implementation: {rowkernel.implementation()}")
    result: dict[str, Any] = {"calls": args.calls, "shapes": []}
    for out_f, in_f in SHAPES[: args.shapes]:
        row = shape_row(out_f, in_f, args.calls)
        result["shapes"].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print("us a call, evaluated together (rows 1 / 4 / 8):")
    for row in result["shapes"]:
        print(f"  {tuple(row['shape'])} floor {row['floor_us']}")
        for key, val in row.items():
            if isinstance(val, dict):
                us = val.get("us", val)
                tail = f"  err {val['rel_err']} row-exact {val['row_exact_8']}" if "rel_err" in val else ""
                print(f"    {key:14s} " + " / ".join(f"{us[m][0]:8.2f}" for m in ROWS) + tail)


if __name__ == "__main__":
    main()
