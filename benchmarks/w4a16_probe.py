"""A tensor-core batched projection (``w4a16_kernel``) against MLX's quantized matmul and a bf16 copy.

Two parts, on an NVIDIA GPU with MLX's CUDA backend:

* ``check``: for every projection shape of the 8B-shaped llama and of SmolLM2-135M (4-bit group 64 and
  group 32, 8-bit group 64) and row counts 8..256, the kernel's output against a float32 reference
  (``x`` in float32 times the dequantized weight), next to MLX's own quantized matmul's error against
  the same reference. Passes when the kernel's largest error is within twice MLX's plus one bf16
  rounding of the output's magnitude.
* ``time``: the projections of ``--layers`` distinct layers of the 8B shapes (q, k, v, o, gate, up,
  down) at each row count, as one graph per repeat, for MLX's quantized matmul, the kernel at each
  tile, bf16 weights through MLX's dense matmul, and each 4-bit weight dequantized to a transient bf16
  copy right before that matmul. Prints milliseconds a step (all layers) as the
  median of ``--repeats`` with the spread, and writes JSON with ``--out``.

    python benchmarks/w4a16_probe.py check
    python benchmarks/w4a16_probe.py time --rows 8,16,32,64,128,256 --out w4a16.json
    python benchmarks/w4a16_probe.py plot --json w4a16.json --out w4a16.png     (any machine)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import w4a16_kernel as w4a16  # noqa: E402
from w4a16_marlin_probe import LLAMA_8B  # noqa: E402

SMOLLM2 = {"q": (576, 576), "kv": (192, 576), "gate": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def _weights(n: int, k: int, bits: int, gs: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    w = mx.random.normal((n, k), key=mx.random.key(seed)).astype(mx.bfloat16) * 0.02
    return mx.quantize(w, group_size=gs, bits=bits)


def check(rows: list[int]) -> bool:
    ok = True
    cases = [(name, shape, 4, 64) for name, shape in LLAMA_8B.items() if name in ("q", "k", "gate", "down")]
    cases += [(f"smollm2 {name}", shape, 4, 32) for name, shape in SMOLLM2.items()]
    cases += [("8-bit gate", LLAMA_8B["gate"], 8, 64), ("smollm2 lm_head q8", SMOLLM2["lm_head"], 8, 32)]
    print(f"{'shape':<22} {'bits':>4} {'gs':>3} {'rows':>5} {'kernel err':>11} {'mlx err':>11} {'bound':>11}  ok")
    for name, (n, k), bits, gs in cases:
        w, s, b = _weights(n, k, bits, gs, seed=n + k + bits)
        wd = mx.dequantize(w, s, b, group_size=gs, bits=bits).astype(mx.float32)
        for m in rows:
            x = (mx.random.normal((m, k), key=mx.random.key(m)) * 0.5).astype(mx.bfloat16)
            ref = x.astype(mx.float32) @ wd.T
            got = w4a16.matmul(x, w, s, b, bits, gs).astype(mx.float32)
            theirs = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits).astype(mx.float32)
            err = mx.max(mx.abs(got - ref)).item()
            mlx_err = mx.max(mx.abs(theirs - ref)).item()
            bound = 2 * mlx_err + mx.max(mx.abs(ref)).item() * 2.0**-8
            good = err <= bound and bool(mx.all(mx.isfinite(got)).item())
            ok &= good
            print(
                f"{name:<22} {bits:>4} {gs:>3} {m:>5} {err:>11.4g} {mlx_err:>11.4g} {bound:>11.4g}  {'ok' if good else 'FAIL'}",
                flush=True,
            )
    return ok


def _median_ms(fn, repeats: int) -> tuple[float, float, float]:
    mx.eval(fn())
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), max(times)


def timing(
    rows: list[int],
    layers: int,
    repeats: int,
    tiles: list[tuple[int, int]],
    out: str | None,
    kernel: bool = True,
    modes: tuple[bool, ...] = (False,),
    with_marlin: bool = False,
) -> None:
    gs, bits = 64, 4
    mats = []
    for layer in range(layers):
        for j, (n, k) in enumerate(LLAMA_8B.values()):
            mats.append(_weights(n, k, bits, gs, seed=layer * 16 + j))
    mx.eval(mats)
    dense = [mx.dequantize(w, s, b, group_size=gs, bits=bits) for w, s, b in mats]
    mx.eval(dense)
    marlin: list[Any] = []
    if with_marlin:
        import w4a16_marlin as w4m

        marlin = [w4m.pack(w, s, b, gs) for w, s, b in mats]
        mx.eval([v for p in marlin for v in vars(p).values() if isinstance(v, mx.array)])
    results = []
    print(f"{'rows':>5} {'arm':<24} {'ms/step':>8} {'min':>7} {'max':>7} {'tok/s (proj only)':>18}", flush=True)
    for m in rows:
        xs = {k: (mx.random.normal((m, k), key=mx.random.key(k)) * 0.5).astype(mx.bfloat16) for k in (4096, 14336)}

        def x_for(i: int, xs: dict[int, mx.array] = xs) -> mx.array:
            return xs[dense[i].shape[1]]

        def q(i: int) -> tuple[mx.array, mx.array, mx.array]:
            return mats[i]

        projs: dict[str, Callable[[mx.array, int], mx.array]] = {
            "mlx qmm": lambda x, i: mx.quantized_matmul(x, *q(i), transpose=True, group_size=gs, bits=bits),
            "bf16 dense": lambda x, i: x @ dense[i].T,
            # 4-bit memory, bf16 speed? Each projection dequantized into a transient bf16 copy, then
            # MLX's dense matmul: one projection's copy alive at a time.
            "dequant+bf16": lambda x, i: x @ mx.dequantize(*q(i), group_size=gs, bits=bits).T,
        }
        for bm, bn in tiles:
            if bm > 16 and bm // 2 >= m:
                continue
            projs[f"kernel {bm}x{bn}"] = lambda x, i, bm=bm, bn=bn: w4a16.matmul(x, *q(i), bits, gs, bm=bm, bn=bn)
        if kernel:
            projs["kernel auto"] = lambda x, i: w4a16.matmul(x, *q(i), bits, gs)
        if marlin:
            projs["marlin"] = lambda x, i: w4m.matmul(x, marlin[i])

        def run(proj: Callable[[mx.array, int], mx.array], chained: bool) -> list[mx.array]:
            """Every projection once; ``chained``: each waits for the previous one's output, as in a forward
            (unchained, MLX CUDA runs independent kernels side by side, which hides a kernel that fills
            few SMs)."""
            if not chained:
                return [proj(x_for(i), i) for i in range(len(mats))]
            outs, dep = [], mx.zeros((1, 1), dtype=mx.bfloat16)
            for i in range(len(mats)):
                outs.append(proj(x_for(i) + dep, i))
                dep = (outs[-1][:1, :1] * 0).astype(mx.bfloat16)
            return outs

        arms = {
            f"{name}{' chained' if chained else ''}": (lambda proj=proj, chained=chained: run(proj, chained))
            for name, proj in projs.items()
            for chained in modes
        }
        for name, fn in arms.items():
            med, lo, hi = _median_ms(fn, repeats)
            step = med * 32 / layers
            results.append({"rows": m, "arm": name, "ms_step": step, "min": lo * 32 / layers, "max": hi * 32 / layers})
            print(
                f"{m:>5} {name:<24} {step:>8.3f} {lo * 32 / layers:>7.3f} {hi * 32 / layers:>7.3f} {m / step * 1e3:>18.0f}",
                flush=True,
            )
    if out:
        Path(out).write_text(
            json.dumps(
                {
                    "device": str(mx.default_device()),
                    "device_name": mx.device_info().get("device_name", ""),
                    "layers": layers,
                    "results": results,
                },
                indent=1,
            )
        )


LABELS = {
    "mlx qmm": "MLX quantized matmul (4-bit)",
    "kernel auto": "retiled sm80 main loop (4-bit)",
    "marlin": "w4a16_marlin (4-bit)",
    "bf16 dense": "bf16 copy of the weights",
    "dequant+bf16": "4-bit dequantized per call, then bf16",
}


def plot(json_path: str, out: str) -> None:
    """Milliseconds a step by rows for each arm the JSON holds: chained (as a forward runs them) solid,
    unchained dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    for i, (arm, label) in enumerate(LABELS.items()):
        for suffix, style in ((" chained", "-"), ("", "--")):
            pts = [(r["rows"], r["ms_step"]) for r in data["results"] if r["arm"] == arm + suffix]
            if pts:
                kind = "chained" if suffix else "independent"
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=f"C{i}", label=f"{label}, {kind}"
                )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (sequences in the batch)")
    ax.set_ylabel("ms for 32 layers' projections")
    ax.set_title(f"8B-shaped projections, one decode step ({data.get('device_name', data['device'])})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["check", "time", "plot"])
    ap.add_argument("--json", default=None, help="plot: the JSON that time wrote")
    ap.add_argument("--rows", default="8,16,32,64,128,256")
    ap.add_argument("--layers", type=int, default=32, help="distinct layers of weights (time)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tiles", default="16x64,32x64,32x128,64x128", help="BMxBN tiles to time besides the default")
    ap.add_argument("--marlin", action="store_true", help="also time benchmarks/w4a16_marlin.py's kernel")
    ap.add_argument("--no-kernel", action="store_true", help="time only MLX's arms (no NVRTC compiles)")
    ap.add_argument(
        "--chained", choices=["no", "yes", "both"], default="no", help="each projection waits for the previous"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.part == "plot":
        plot(args.json, args.out or "w4a16.png")
        return 0
    if not w4a16.available():
        print("w4a16: needs MLX's CUDA backend on the default device", file=sys.stderr)
        return 2
    if args.part == "check":
        return 0 if check(rows) else 1
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t]
    timing(
        rows,
        args.layers,
        args.repeats,
        [] if args.no_kernel else tiles,
        args.out,
        not args.no_kernel,
        {"no": (False,), "yes": (True,), "both": (False, True)}[args.chained],
        args.marlin,
    )  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
