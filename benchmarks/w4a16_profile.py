"""The w4a16 kernel on one projection shape, each tile launched a few times: its time a launch, and
launches for a profiler to read (MLX CUDA only).

    ncu --clock-control none -k regex:mlx_batchd_w4n --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python3 benchmarks/w4a16_profile.py --n 14336 --k 4096 --rows 256 --tiles 0,1 [--regs 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import mlx.core as mx

from workers.kernels import w4a16, w4a16_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tiles", default=",".join(str(i) for i in range(len(w4a16_source.TILES))))
    ap.add_argument("--launches", type=int, default=20, help="timed launches a tile (after 3 untimed)")
    ap.add_argument("--regs", type=int, default=None, help="each tile's register cap instead of its plan's (0: none)")
    args = ap.parse_args()
    w = (mx.random.normal((args.n, args.k)) * 0.02).astype(mx.bfloat16)
    weight = w4a16.native(*mx.quantize(w, group_size=args.group_size, bits=4), args.group_size)
    x = (mx.random.normal((args.rows, args.k)) * 0.5).astype(mx.bfloat16)
    dense = mx.dequantize(weight.w, weight.scales, weight.biases, args.group_size).astype(mx.bfloat16)
    mx.eval(weight.w, x, dense)
    flops = 2 * args.rows * args.n * args.k
    for tile in (int(t) for t in args.tiles.split(",")):
        p = w4a16.tile_plan(args.rows, args.n, args.k, tile)
        if args.regs is not None:
            p = dataclasses.replace(p, regs=args.regs)
        times = []
        for i in range(3 + args.launches):
            mx.synchronize()
            tic = time.perf_counter()
            mx.eval(w4a16.native_matmul(x, weight, p))
            mx.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - tic)
        med = statistics.median(times)
        print(f"tile {tile} {w4a16_source.TILES[tile]} {p}: {1e6 * med:.1f} us ({flops / med / 1e12:.0f} TFLOP/s)")
    times = []
    for i in range(3 + args.launches):
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(x @ dense.T)
        mx.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - tic)
    med = statistics.median(times)
    print(f"bf16 dense: {1e6 * med:.1f} us ({flops / med / 1e12:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
