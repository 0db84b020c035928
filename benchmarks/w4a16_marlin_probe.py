"""The Marlin-style w4a16 GEMMs (``w4a16_marlin``: repacked and native) against MLX's quantized matmul
and a bf16 copy.

* ``check`` (CUDA): every projection shape of the 8B-shaped llama (group 64) and of SmolLM2-135M (groups
  32 and 64) at rows 1, 16, 32, 64, 128, 256: each kernel's largest error against a float32 reference
  (``x`` in float32 times ``mx.dequantize``'s weights in float32), MLX's ``mx.quantized_matmul`` error
  and MLX's dense bf16 matmul error against the same reference. A kernel fails when its error exceeds
  1.25 x the larger MLX error plus half a bf16 ulp of the largest output, or is not finite. Also checks
  that ``unrepack`` gives MLX's arrays back.
* ``time`` (CUDA): the projections of 32 distinct layers of the 8B shapes (q, k, v, o, gate, up, down)
  at each row count as one graph a repeat, for MLX's 4-bit quantized matmul, the repacked kernel
  (``marlin``), the native kernel (MLX's arrays as they are), each with the default plan and any
  ``--variants``, the 4-bit weights dequantized to bf16 at each call and then MLX's dense matmul
  (a transient bf16 copy, one projection at a time: ``dequant`` with the project's dequantize kernel,
  ``dequant-mlx`` with ``mx.dequantize``; ``dequant-l2`` dequantizes and multiplies in output slices of at
  most ``--l2-mb`` megabytes of bf16 each (whole 128s of outputs where that many fit), small enough for
  the L2 to hold a slice between its write and its product), and bf16 weights through MLX's dense matmul. Unchained, the projections are
  independent; ``--chained``, projection i's input is ``x + out_{i-1}[:1, :1] * 0`` (one compiled
  elementwise kernel, the same for every arm), so each waits for the last: a decode forward's latency.
  Prints the median ms of running the graph (``mx.eval``) over ``--repeats`` with the min-max, the
  median us a projection, the 4-bit weight bandwidth, the median ms of building the graph, and the plan.
* ``emulate`` (any backend, e.g. this CPU): the same error table for the SmolLM2 shapes and the 8B k/v
  shape with the kernels replaced by their numpy emulations (``emulate``, ``emulate_native``).

    python3 benchmarks/w4a16_marlin_probe.py check
    python3 benchmarks/w4a16_marlin_probe.py time --rows 16,32,64,128,256 --repeats 5
    python3 benchmarks/w4a16_marlin_probe.py time --chained --arms marlin,native --variants "nb=1;splits=1"
    python3 benchmarks/w4a16_marlin_probe.py emulate
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import w4a16_marlin as w4m  # noqa: E402

from workers.kernels import dequant_kernel  # noqa: E402

LLAMA_8B = {
    "q": (4096, 4096),
    "k": (1024, 4096),
    "v": (1024, 4096),
    "o": (4096, 4096),
    "gate": (14336, 4096),
    "up": (14336, 4096),
    "down": (4096, 14336),
}
SMOLLM2 = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536)}
CHECK_ROWS = [1, 16, 32, 64, 128, 256]


def _weights(n: int, k: int, gs: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    w = mx.random.normal((n, k), key=mx.random.key(seed)).astype(mx.bfloat16) * 0.02
    q, s, b = mx.quantize(w, group_size=gs, bits=4)
    return q, s, b


def _cases(emulated: bool) -> list[tuple[str, int, int, int]]:
    """(name, N, K, group size) of the shapes to check."""
    if emulated:
        cases = [("8b k/v", *LLAMA_8B["k"], 64)]
    else:
        cases = [("8b q/o", *LLAMA_8B["q"], 64), ("8b k/v", *LLAMA_8B["k"], 64)]
        cases += [("8b gate/up", *LLAMA_8B["gate"], 64), ("8b down", *LLAMA_8B["down"], 64)]
    for gs in (32, 64):
        cases += [(f"smollm2 {name}", n, k, gs) for name, (n, k) in SMOLLM2.items()]
    return cases


def _max_abs(a: mx.array) -> float:
    return float(np.array(mx.max(mx.abs(a))))


def _half_ulp(v: float) -> float:
    """Half a bf16 ulp at magnitude ``v`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(v)) - 8) if v > 0 else 0.0


def check(rows: list[int], kernels: list[str], emulated: bool = False) -> bool:
    """The error table; True when every case is within its bound.

    Columns: each kernel's largest error against the float32 reference (float32 ``x`` times
    ``mx.dequantize``'s weights), MLX's ``quantized_matmul`` error (it keeps the dequantized weight in
    float32: one output rounding), the error of MLX's dense bf16 matmul of the same weights (a bf16
    copy through cuBLAS, as a bf16-MMA kernel rounds them), and the bound: 1.25 x the larger of the two
    MLX errors plus half a bf16 ulp of the largest output. An index bug gives errors of the outputs' own
    size, far past it."""
    ok = True
    cols = "".join(f" {k:>10}" for k in kernels)
    print(
        f"{'shape':<18} {'N':>6} {'K':>6} {'gs':>3} {'rows':>5}{cols} {'mlx qmm':>10} {'bf16 dense':>10} {'bound':>10}  ok"
    )
    for name, n, k, gs in _cases(emulated):
        q, s, b = _weights(n, k, gs, seed=n * 7 + k + gs)
        packed = w4m.pack(q, s, b, gs)
        nat = w4m.native(q, s, b, gs)
        if "marlin" in kernels:
            back = w4m.unrepack(packed.wq, packed.sb, gs)
            same = all(mx.array_equal(u, v).item() for u, v in zip(back, (q, s, b)))
            size = packed.nbytes / (q.nbytes + s.nbytes + b.nbytes)
            if not same or size > 1.15:
                print(f"{name}: repack round trip {'ok' if same else 'FAILED'}, resident {size:.3f}x of MLX's 4-bit")
                ok = False
        wbf = mx.dequantize(q, s, b, group_size=gs, bits=4).astype(mx.bfloat16)
        wd = wbf.astype(mx.float32)
        for m in rows:
            x = (mx.random.normal((m, k), key=mx.random.key(m + n)) * 0.5).astype(mx.bfloat16)
            ref = x.astype(mx.float32) @ wd.T
            errs, finite = [], True
            for kern in kernels:
                p = w4m.plan(m, n, k)
                if emulated:
                    em = w4m.emulate(x, packed, p) if kern == "marlin" else w4m.emulate_native(x, nat, p)
                    got = mx.array(em).astype(mx.bfloat16).astype(mx.float32)
                else:
                    got = (w4m.matmul(x, packed) if kern == "marlin" else w4m.native_matmul(x, nat)).astype(mx.float32)
                errs.append(_max_abs(got - ref))
                finite &= bool(mx.all(mx.isfinite(got)).item())
            theirs = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=4).astype(mx.float32)
            dense = (x @ wbf.T).astype(mx.float32)
            mlx_err = _max_abs(theirs - ref)
            dense_err = _max_abs(dense - ref)
            bound = 1.25 * max(mlx_err, dense_err) + _half_ulp(_max_abs(ref))
            good = finite and all(e <= bound for e in errs)
            ok &= good
            ecols = "".join(f" {e:>10.4g}" for e in errs)
            print(
                f"{name:<18} {n:>6} {k:>6} {gs:>3} {m:>5}{ecols} {mlx_err:>10.4g} {dense_err:>10.4g} {bound:>10.4g}  "
                f"{'ok' if good else 'FAIL'}",
                flush=True,
            )
    return ok


def _median_ms(fn: Callable[[], Any], repeats: int) -> tuple[float, float, float, float]:
    """(median, min, max) ms of evaluating the graph ``fn`` builds, and the median ms of building it.
    The graph is lazy, so the GPU starts at ``mx.eval``: building (Python and MLX's per-op cost, which
    a custom kernel's call pays more of) is timed apart from running."""
    mx.eval(fn())
    mx.eval(fn())
    runs, builds = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = fn()
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        builds.append((t1 - t0) * 1e3)
        runs.append((t2 - t1) * 1e3)
    return statistics.median(runs), min(runs), max(runs), statistics.median(builds)


VARIANT_FIELDS = ("mt", "nb", "warps", "splits", "ctas_per_sm", "reduce", "xbuf", "stages", "regs", "min_steps")
ARMS = ("mlx-4bit", "marlin", "native", "dequant", "dequant-l2", "dequant-mlx", "bf16")


def _variant(spec: str) -> dict[str, float]:
    """'nb=1,ctas_per_sm=8' -> plan overrides (reduce=0: the partials added by an MLX sum; xbuf is the
    repacked kernel's, stages the native kernel's)."""
    out: dict[str, float] = {}
    for part in spec.split(","):
        key, _, val = part.partition("=")
        if key.strip() not in VARIANT_FIELDS:
            raise SystemExit(f"w4a16_marlin_probe: bad variant field {key!r} ({', '.join(VARIANT_FIELDS)})")
        try:
            out[key.strip()] = float(val)
        except ValueError:
            raise SystemExit(f"w4a16_marlin_probe: bad variant value {part!r} (field=number)") from None
    return out


def _plan_for(m: int, n: int, k: int, over: dict[str, float]) -> w4m.Plan:
    ints = {
        key: int(v)
        for key, v in over.items()
        if key in ("mt", "nb", "warps", "splits", "xbuf", "stages", "regs", "min_steps")
    }
    return w4m.plan(m, n, k, ctas_per_sm=over.get("ctas_per_sm"), reduce=bool(over.get("reduce", 1)), **ints)


def _plan_note(m: int, over: dict[str, float]) -> str:
    """The plan's fixed fields and each 8B shape's K slices, e.g. 'mt1 nb2 w4 xb2 st4 splits q2 k8 gate1 down4'."""
    p = _plan_for(m, *LLAMA_8B["q"], over)
    splits = " ".join(f"{name}{_plan_for(m, n, k, over).splits}" for name, (n, k) in LLAMA_8B.items() if name != "v")
    return f"mt{p.mt} nb{p.nb} w{p.warps} xb{p.xbuf} st{p.stages} red{int(p.reduce)} r{p.regs} splits {splits}"


@functools.cache
def _link_compiled() -> Callable[[mx.array, mx.array], mx.array]:
    return mx.compile(lambda x, y: x + y[:1, :1] * 0)


def _link(x: mx.array, prev: mx.array, compiled: bool) -> mx.array:
    """``x + prev[:1, :1] * 0`` in bf16: the same activations, made to wait for ``prev``."""
    return _link_compiled()(x, prev) if compiled else x + prev[:1, :1] * 0


def _graph(
    proj: Callable[[int, mx.array], mx.array], xs: list[mx.array], chained: bool, compiled_link: bool
) -> list[mx.array]:
    """Every projection once: independent (all outputs), or chained (projection i's input waits for
    projection i - 1's output, as in a forward pass; the last output)."""
    prev: mx.array | None = None
    outs = []
    for i, x in enumerate(xs):
        if chained and prev is not None:
            x = _link(x, prev, compiled_link)
        prev = proj(i, x)
        outs.append(prev)
    return [prev] if chained and prev is not None else outs


def timing(
    rows: list[int],
    layers: int,
    repeats: int,
    variants: list[str],
    arms_wanted: list[str],
    chained: bool,
    compiled_link: bool,
    out: str | None,
    l2_mb: list[int] | None = None,
) -> None:
    gs = 64
    mats = []
    packed: list[w4m.Packed] = []
    natives: list[w4m.Native] = []
    for layer in range(layers):
        for j, (n, k) in enumerate(LLAMA_8B.values()):
            q, s, b = _weights(n, k, gs, seed=layer * 16 + j)
            mx.eval(q, s, b)
            mats.append((q, s, b))
            if "marlin" in arms_wanted:
                pk = w4m.pack(q, s, b, gs)
                mx.eval(pk.wq, pk.sb, pk.locks)
                packed.append(pk)
            if "native" in arms_wanted:
                nw = w4m.native(q, s, b, gs)
                mx.eval(nw.locks)
                natives.append(nw)
    dense = [mx.dequantize(q, s, b, group_size=gs, bits=4) for q, s, b in mats] if "bf16" in arms_wanted else []
    mx.eval(dense)
    bytes_4bit = sum(q.nbytes + s.nbytes + b.nbytes for q, s, b in mats)
    mode = f"chained ({'compiled' if compiled_link else 'plain'} link)" if chained else "unchained"
    print(
        f"device {mx.default_device()}, {layers} layers, {len(mats)} projections, {mode}, "
        f"4-bit weights {bytes_4bit / 1e9:.2f} GB",
        flush=True,
    )
    results = []
    print(
        f"{'rows':>5} {'arm':<34} {'ms/32L':>8} {'min':>7} {'max':>7} {'us/proj':>8} {'4-bit GB/s':>10} "
        f"{'build ms':>9}  plan",
        flush=True,
    )
    ks = [q.shape[1] * 8 for q, _, _ in mats]
    for m in rows:
        xk = {k: (mx.random.normal((m, k), key=mx.random.key(k)) * 0.5).astype(mx.bfloat16) for k in sorted(set(ks))}
        mx.eval(xk)
        xs = [xk[k] for k in ks]

        def mlx_4bit(i: int, x: mx.array) -> mx.array:
            q, s, b = mats[i]
            return mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=4)

        def marlin(i: int, x: mx.array, over: dict[str, float] | None = None, m: int = m) -> mx.array:
            pk = packed[i]
            return w4m.matmul(x, pk, None if over is None else _plan_for(m, pk.n, pk.k, over))

        def native(i: int, x: mx.array, over: dict[str, float] | None = None, m: int = m) -> mx.array:
            nw = natives[i]
            return w4m.native_matmul(x, nw, None if over is None else _plan_for(m, nw.n, nw.k, over))

        def bf16_dense(i: int, x: mx.array) -> mx.array:
            return x @ dense[i].T

        def dequant(i: int, x: mx.array) -> mx.array:
            q, s, b = mats[i]
            return x @ dequant_kernel.launch(q, s, b, gs).T

        def dequant_l2(i: int, x: mx.array, mb: int = 8) -> mx.array:
            q, s, b = mats[i]
            n, k = q.shape[0], q.shape[1] * 8
            step = max(1, (mb << 20) // (k * 2))  # outputs a slice, whole 128s where that many fit
            step = step // 128 * 128 if step >= 128 else step
            parts = [
                x @ dequant_kernel.launch(q[lo : lo + step], s[lo : lo + step], b[lo : lo + step], gs).T
                for lo in range(0, n, step)
            ]
            return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)

        def dequant_mlx(i: int, x: mx.array) -> mx.array:
            q, s, b = mats[i]
            return x @ mx.dequantize(q, s, b, group_size=gs, bits=4).T

        arms: dict[str, tuple[Callable[[int, mx.array], mx.array], str]] = {}
        if "mlx-4bit" in arms_wanted:
            arms["mlx-4bit"] = (mlx_4bit, "")
        for kern, kfn in (("marlin", marlin), ("native", native)):
            if kern not in arms_wanted:
                continue
            arms[kern] = (kfn, _plan_note(m, {}))
            for spec in variants:
                over = _variant(spec)
                arms[f"{kern} {spec}"] = (functools.partial(kfn, over=over), _plan_note(m, over))
        if "dequant" in arms_wanted:
            arms["dequant"] = (dequant, "")
        if "dequant-l2" in arms_wanted:
            for mb in l2_mb or [8]:
                arms[f"dequant-l2 {mb} MB"] = (functools.partial(dequant_l2, mb=mb), "")
        if "dequant-mlx" in arms_wanted:
            arms["dequant-mlx"] = (dequant_mlx, "")
        if "bf16" in arms_wanted:
            arms["bf16 dense"] = (bf16_dense, "")
        for name, (proj, note) in arms.items():
            med, lo, hi, build = _median_ms(functools.partial(_graph, proj, xs, chained, compiled_link), repeats)
            scale = 32 / layers
            bw = bytes_4bit / (med * 1e-3) / 1e9 if name != "bf16 dense" else float("nan")
            per = med * 1e3 / len(xs)
            results.append(
                {
                    "rows": m,
                    "arm": name,
                    "mode": "chained" if chained else "unchained",
                    "ms_step": med * scale,
                    "min": lo * scale,
                    "max": hi * scale,
                    "us_per_projection": per,
                    "build_ms": build,
                    "plan": note,
                }
            )
            print(
                f"{m:>5} {name:<34} {med * scale:>8.3f} {lo * scale:>7.3f} {hi * scale:>7.3f} {per:>8.1f} {bw:>10.0f} "
                f"{build:>9.2f}  {note}",
                flush=True,
            )
    if out:
        Path(out).write_text(
            json.dumps(
                {"device": str(mx.default_device()), "layers": layers, "chained": chained, "results": results},
                indent=1,
            )
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("part", choices=["check", "time", "emulate"])
    ap.add_argument("--rows", default=None, help="comma-separated row counts")
    ap.add_argument("--layers", type=int, default=32, help="distinct layers of weights (time)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default="", help="';'-separated plan overrides to time too, e.g. 'nb=1;splits=1'")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"time: comma-separated subset of {','.join(ARMS)}")
    ap.add_argument("--kernels", default="marlin,native", help="check/emulate: marlin, native or both")
    ap.add_argument("--chained", action="store_true", help="time: each projection's input waits for the last output")
    ap.add_argument("--plain-link", action="store_true", help="time --chained: the link as 3 MLX ops, not compiled")
    ap.add_argument("--out", default=None, help="time: write the results as JSON here")
    ap.add_argument("--l2-mb", default="8", help="time, arm dequant-l2: comma-separated slice sizes in MB")
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")] if args.rows else None
        l2_mb = [int(v) for v in args.l2_mb.split(",")]
    except ValueError:
        print("w4a16_marlin_probe: --rows and --l2-mb take comma-separated integers", file=sys.stderr)
        return 2
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    kernels = [a.strip() for a in args.kernels.split(",") if a.strip()]
    if (
        not arms
        or any(a not in ARMS for a in arms)
        or not kernels
        or any(k not in ("marlin", "native") for k in kernels)
    ):
        print(f"w4a16_marlin_probe: --arms takes {','.join(ARMS)}; --kernels marlin,native", file=sys.stderr)
        return 2
    if args.part == "emulate":
        return 0 if check(rows or [1, 16, 40], kernels, emulated=True) else 1
    variants = [v for v in args.variants.split(";") if v.strip()]
    for v in variants:
        _variant(v)
    if not w4m.available():
        print("w4a16_marlin_probe: check and time need MLX's CUDA backend (emulate runs anywhere)", file=sys.stderr)
        return 2
    if args.part == "check":
        return 0 if check(rows or CHECK_ROWS, kernels) else 1
    timing(
        rows or [16, 32, 64, 128, 256],
        args.layers,
        args.repeats,
        variants,
        arms,
        args.chained,
        not args.plain_link,
        args.out,
        l2_mb,
    )
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
