"""Where the w4a16 kernel's outputs leave MLX's (device runs): its effective weights and its error by position.

On the H100 the native kernel's mean error against a float32 reference is 3.6x MLX's own on the same bf16
weights, while its CPU emulation (``w4a16_marlin_emulate``) matches MLX's. This probe tells the two
possible causes apart on the device:

* ``weights``: the kernel on one-hot rows (``x = I``) returns the weights it built in registers; each is
  compared bit for bit with ``mx.dequantize``, and mismatches are counted by nibble position in the
  packed word, by K within a k64 step and by output within a 16-block;
* ``sums``: on random rows, the kernel's error against the float32 reference next to the emulator's and
  a dense bf16 matmul's, for the plan's split count and for one K slice (``splits=1``).

    PYTHONPATH=$SITE:$PWD python3 benchmarks/w4a16_diagnose.py --n 1024 --k 4096
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import w4a16_marlin as w4m  # noqa: E402


def weights(n: int, k: int, gs: int) -> None:
    w = mx.random.normal((n, k), key=mx.random.key(11)).astype(mx.bfloat16) * 0.02
    q, s, b = mx.quantize(w, group_size=gs, bits=4)
    want = np.array(mx.dequantize(q, s, b, group_size=gs, bits=4).astype(mx.bfloat16).view(mx.uint16))
    nat = w4m.native(q, s, b, gs)
    got = np.zeros((n, k), dtype=np.uint16)
    for k0 in range(0, k, 64):
        eye = mx.zeros((64, k), dtype=mx.bfloat16)
        eye = eye.at[mx.arange(64), mx.arange(k0, k0 + 64)].add(mx.array(1.0, dtype=mx.bfloat16))
        out = w4m.native_matmul(eye, nat, w4m.plan(64, n, k, splits=1))
        got[:, k0 : k0 + 64] = np.array(out.view(mx.uint16)).T
    bad = got != want
    print(f"weights: {int(bad.sum())} of {bad.size} differ from mx.dequantize")
    if bad.any():
        rows, cols = np.nonzero(bad)
        print(" by nibble in word (K % 8):", sorted(Counter(cols % 8).items()))
        print(" by K % 64:", sorted(Counter(cols % 64).items())[:16], "...")
        print(" by output % 16:", sorted(Counter(rows % 16).items()))
        gv = got.astype(np.uint32) << 16
        wv = want.astype(np.uint32) << 16
        ratio = gv.view(np.float32)[bad] / wv.view(np.float32)[bad]
        print(
            " got / want at mismatches: median",
            float(np.median(ratio)),
            "min",
            float(ratio.min()),
            "max",
            float(ratio.max()),
        )


def sums(n: int, k: int, gs: int, m: int) -> None:
    w = mx.random.normal((n, k), key=mx.random.key(12)).astype(mx.bfloat16) * 0.02
    q, s, b = mx.quantize(w, group_size=gs, bits=4)
    nat = w4m.native(q, s, b, gs)
    wbf = mx.dequantize(q, s, b, group_size=gs, bits=4).astype(mx.bfloat16)
    x = (mx.random.normal((m, k), key=mx.random.key(13)) * 0.5).astype(mx.bfloat16)
    ref = np.array(x.astype(mx.float32)) @ np.array(wbf.astype(mx.float32)).T  # numpy: no TF32
    dense = np.array((x @ wbf.T).astype(mx.float32))
    print(f"sums, {m} rows: mean |error| against float32 (numpy)")
    print(f" dense bf16 {np.abs(dense - ref).mean():.3g}")
    for label, p in (("plan", w4m.plan(m, n, k)), ("one K slice", w4m.plan(m, n, k, splits=1))):
        got = np.array(w4m.native_matmul(x, nat, p).astype(mx.float32))
        emu = np.array(mx.array(w4m.emulate_native(x, nat, p)).astype(mx.bfloat16).astype(mx.float32))
        err = np.abs(got - ref)
        print(
            f" kernel {label} (splits {p.splits}) {err.mean():.3g}, its emulation {np.abs(emu - ref).mean():.3g}, "
            f"kernel vs emulation differ at {int((got != emu).sum())} of {got.size}"
        )
        worst = np.unravel_index(np.argmax(err), err.shape)
        print(f"  worst at row {worst[0]}, output {worst[1]}: got {got[worst]:.6g}, ref {ref[worst]:.6g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--gs", type=int, default=64)
    ap.add_argument("--rows", type=int, default=16)
    args = ap.parse_args()
    weights(args.n, min(args.k, 1024), args.gs)
    sums(args.n, args.k, args.gs, args.rows)


if __name__ == "__main__":
    main()
