"""Device measurement: how fast the project's quantized row kernel reads the weights, by variant (MLX CUDA).

    python benchmarks/qmv_variants_probe.py --out variants.json [--quick]
    python benchmarks/qmv_variants_probe.py --plot "4-byte loads=a.json" "16-byte loads=b.json" --out loads.png

Why: the kernel's arithmetic is fixed (each output must be MLX's one-row call's, byte for byte), but
how a call is laid out over the GPU is not: outputs per warp (each x tile shared by more outputs, more
registers a lane), warps a block (smaller blocks let an SM hold more of them when a lane needs many
registers) and weight tiles a lane loads ahead (loads in flight a warp). Which suits which row count is measured here, not reasoned: on the H200 the kernel is
bound by its instructions and the L1's wavefronts, not by HBM (measured with this probe, 2026-12-04).

For each shape (out x in: 4096x4096, 14336x4096, 4096x14336) and row count, each variant's rows are
compared byte for byte with MLX's one-row ``quantized_matmul`` of each row, and timed: CALLS calls
chained in one graph over copies of the matrix (more bytes than the L2 holds, so each call reads HBM),
median of ROUNDS, microseconds a call and GB/s of weights, scales and biases read; ``--chained`` makes each
call's rows wait for the previous call's output (one tiny MLX op between, the same for every arm), as a
decode forward's projections do, instead of letting independent calls overlap. ``stream`` reads the
same bytes with 16-byte loads and no arithmetic (what a call could cost), ``mlx`` is MLX's quantized
matmul on the rows as mlx-lm calls it, ``add`` is one MLX op on a tiny array (a graph node's floor).
``best`` weighs each shape by how often an 8B layer reads it and names, by row count, the fastest exact
variant (outputs per warp, warps a block, tiles ahead: what ``workers/kernels/qmv_launch.py``'s ``PER_WARP``,
``BLOCK_WARPS`` and ``AHEAD`` fix). Exits 2 where MLX has no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from workers.kernels import qmv_rows
from workers.kernels.byte_equal import bytes_equal

ROUNDS = 5
#: Bytes the copies of a matrix add up to at least (the H200's L2 is 50 MB).
POOL_BYTES = 160 << 20

STREAM_BODY = """
  const uint4* p = reinterpret_cast<const uint4*>(w);
  const size_t n16 = (size_t)w_shape[0] * w_shape[1] / 4;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  uint32_t acc = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] = acc;
"""

_stream: list[Any] = []


def variant_call(r: int, warps: int, u: int) -> Callable[..., mx.array]:
    """A call of ``qmv_rows``' kernel with r outputs per warp, ``warps`` warps a block and u weight tiles
    loaded ahead: (x, w, scales, biases) -> (rows, out)."""

    def call(x: mx.array, w: mx.array, sc: mx.array, b: mx.array) -> mx.array:
        n = int(w.shape[0])
        outs_warps = -(-n // r)
        blocks = -(-outs_warps // warps)
        return qmv_rows._kernel(1)(
            inputs=[x, w, sc, b],
            template=[("T", x.dtype), ("M", x.shape[0]), ("GS", 64), ("BITS", 4), ("R", r), ("U", u)],
            grid=(blocks * warps * 32, 1, 1),
            threadgroup=(warps * 32, 1, 1),
            output_shapes=[(x.shape[0], n)],
            output_dtypes=[x.dtype],
        )[0]

    return call


def stream_call(w: mx.array) -> mx.array:
    threads = 132 * 2048
    if not _stream:
        _stream.append(
            mx.fast.cuda_kernel(name="qmv_probe_stream", input_names=["w"], output_names=["out"], source=STREAM_BODY)
        )
    return _stream[0](
        inputs=[w], grid=(threads, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(threads,)], output_dtypes=[mx.uint32]
    )[0]


#: Set by ``--chained``: each call's rows wait for the previous call's output.
CHAINED = False


def _graph(calls: list[Callable[[mx.array], mx.array]], x: mx.array) -> list[mx.array]:
    """Every call once on ``x``; chained, call j's rows are ``x`` plus a zero from call j - 1's output."""
    outs: list[mx.array] = []
    for c in calls:
        xi = x if not (CHAINED and outs) else x + (outs[-1].reshape(-1)[:1] * 0).astype(x.dtype)
        outs.append(c(xi))
    return outs


def _timed(calls: list[Callable[[mx.array], mx.array]], x: mx.array) -> float:
    """Microseconds a call, every call in one graph, median of ROUNDS (one untimed first)."""
    mx.eval(_graph(calls, x))
    times = []
    for _ in range(ROUNDS):
        outs = _graph(calls, x)
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - tic) / len(calls) * 1e6)
    return statistics.median(times)


#: (outputs per warp, warps a block, tiles ahead) tried by row count; the first is ``qmv_rows``' launch today.
VARIANTS = {
    1: [
        (2, 4, 1),
        (2, 4, 2),
        (2, 4, 4),
        (2, 4, 8),
        (1, 4, 8),
        (1, 8, 8),
        (1, 2, 8),
        (4, 4, 4),
        (2, 8, 4),
        (4, 4, 2),
        (8, 4, 1),
        (8, 4, 2),
    ],
    4: [(4, 8, 1), (2, 8, 1), (2, 4, 1), (1, 4, 1), (4, 8, 2), (2, 4, 4)],
    5: [(4, 8, 1), (2, 8, 1), (2, 4, 1), (1, 4, 1), (4, 8, 2), (2, 4, 4)],
    8: [(2, 4, 1), (2, 8, 1), (1, 4, 1), (1, 8, 1), (2, 4, 2), (1, 4, 4)],
}
#: How often an 8B llama layer reads each shape (q/k/v count as 1.5 of 4096x4096, o as 1).
WEIGHTS = {"4096x4096": 2.5, "14336x4096": 2.0, "4096x14336": 1.0}


def _mlx(x: mx.array, mat: tuple[mx.array, ...]) -> mx.array:
    return mx.quantized_matmul(x, mat[0], mat[1], mat[2], transpose=True, group_size=64, bits=4)


def _name(r: int, w: int, u: int) -> str:
    return f"R{r}-W{w}-U{u}"


def measure_shape(n: int, k: int, rows: list[int]) -> dict[str, Any]:
    w0 = (mx.random.normal((n, k), key=mx.random.key(n + k)) * 0.02).astype(mx.bfloat16)
    first = mx.quantize(w0, group_size=64, bits=4)
    mx.eval(first)
    nbytes = sum(a.nbytes for a in first)
    copies = max(2, -(-POOL_BYTES // nbytes))
    pool = [first] + [tuple(a + 0 for a in first) for _ in range(copies - 1)]
    mx.eval(pool)
    calls_n = max(24, 2 * copies)
    out: dict[str, Any] = {"bytes": nbytes, "copies": copies, "calls": calls_n}
    t = _timed([lambda _x, j=j: stream_call(pool[j % copies][0]) for j in range(calls_n)], mx.zeros((1,)))
    wbytes = first[0].nbytes
    out["stream"] = {"us": round(t, 2), "gbs_weights": round(wbytes / t / 1e3, 1)}
    print(f"  {n}x{k} stream: {t:.1f} us ({wbytes / t / 1e3:.0f} GB/s of packed weights)", flush=True)
    for m in rows:
        x = (mx.random.normal((m, k), key=mx.random.key(m)) * 0.5).astype(mx.bfloat16)
        w, sc, b = first
        ref = [mx.quantized_matmul(x[i : i + 1], w, sc, b, transpose=True, group_size=64, bits=4) for i in range(m)]
        mx.eval(x, ref)
        res: dict[str, Any] = {}
        t = _timed([lambda xi, j=j: _mlx(xi, pool[j % copies]) for j in range(calls_n)], x)
        res["mlx"] = {"us": round(t, 2), "gbs": round(nbytes / t / 1e3, 1)}
        print(f"  {n}x{k} rows {m} mlx: {res['mlx']}", flush=True)
        for r, warps, u in VARIANTS[m]:
            name = _name(r, warps, u)
            call = variant_call(r, warps, u)
            try:
                got = call(x, w, sc, b)
                mx.eval(got)
                exact = all(bytes_equal(got[i : i + 1], ref[i]) for i in range(m))
                t = _timed([lambda xi, j=j, call=call: call(xi, *pool[j % copies]) for j in range(calls_n)], x)
                res[name] = {"us": round(t, 2), "gbs": round(nbytes / t / 1e3, 1), "exact": exact}
            except Exception as exc:  # one variant failing keeps the others' figures
                res[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"  {n}x{k} rows {m} {name}: {res[name]}", flush=True)
        out[f"rows{m}"] = res
    return out


def best(report: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """By row count, the exact variant with the least 8B-layer-weighted time over the shapes (its
    outputs per warp and warps a block, as ``workers/kernels/qmv_launch.py`` names them)."""
    chosen: dict[int, tuple[int, int, int]] = {}
    table: dict[str, Any] = {}
    for m in rows:
        totals = {}
        for v in VARIANTS[m]:
            name = _name(*v)
            cells = [report["shapes"][shape][f"rows{m}"].get(name, {}) for shape in WEIGHTS]
            if all(c.get("exact") for c in cells):
                totals[v] = sum(WEIGHTS[shape] * c["us"] for shape, c in zip(WEIGHTS, cells, strict=True))
        mlx = sum(WEIGHTS[shape] * report["shapes"][shape][f"rows{m}"]["mlx"]["us"] for shape in WEIGHTS)
        if totals:
            chosen[m] = min(totals, key=lambda v: totals[v])
        table[f"rows{m}"] = {
            "layer_us": {_name(*v): round(t, 1) for v, t in totals.items()},
            "mlx_layer_us": round(mlx, 1),
        }
    fastest = {f"rows{m}": {"per_warp": v[0], "warps": v[1], "ahead": v[2]} for m, v in chosen.items()}
    return {"table": table, "fastest": fastest}


def plot(reports: list[str], labels: list[str], png: str) -> None:
    """Microseconds an 8B layer's projections take by row count (``best``'s weighted sums): each
    report's default variant and its fastest exact one, and MLX's quantized matmul."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for path, label in zip(reports, labels, strict=True):
        with open(path) as f:
            table = json.load(f)["best"]["table"]
        rows = sorted(int(k[4:]) for k in table)
        first = [next(iter(table[f"rows{m}"]["layer_us"].values())) for m in rows]
        fastest = [min(table[f"rows{m}"]["layer_us"].values()) for m in rows]
        ax.plot(rows, first, "o--", label=f"{label}: first variant")
        ax.plot(rows, fastest, "s-", label=f"{label}: fastest exact")
    ax.plot(rows, [table[f"rows{m}"]["mlx_layer_us"] for m in rows], "x:", color="grey", label="MLX quantized matmul")
    ax.set_xlabel("rows a call")
    ax.set_ylabel("us an 8B layer's projections (HBM-resident weights)")
    ax.set_title("qmv_rows on the H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="rows 1 and 5 only")
    ap.add_argument("--rows", help="row counts, comma-separated (of 1, 4, 5, 8)")
    ap.add_argument("--chained", action="store_true", help="each call waits for the previous one's output")
    ap.add_argument("--plot", nargs="+", metavar="LABEL=JSON", help="only plot earlier reports to --out (a PNG)")
    a = ap.parse_args()
    if a.plot:
        labels, paths = zip(*(item.split("=", 1) for item in a.plot), strict=True)
        plot(list(paths), list(labels), a.out)
        return 0
    if not mx.cuda.is_available():
        print("qmv_variants_probe: MLX has no CUDA device here")
        return 2
    global CHAINED
    CHAINED = a.chained
    rows = [int(r) for r in a.rows.split(",")] if a.rows else [1, 5] if a.quick else [1, 4, 5, 8]
    tic = time.perf_counter()
    add_x = mx.zeros((1024,), dtype=mx.bfloat16)
    add_us = round(_timed([lambda xi: xi + 1 for _ in range(64)], add_x), 2)
    report: dict[str, Any] = {"chained": CHAINED, "add_us": add_us, "shapes": {}}
    print(f"one MLX op in a graph: {report['add_us']} us", flush=True)
    for shape in WEIGHTS:
        n, k = map(int, shape.split("x"))
        report["shapes"][shape] = measure_shape(n, k, rows)
        print(f"{shape} done at {time.perf_counter() - tic:.0f} s", flush=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    report["best"] = best(report, rows)
    print(json.dumps(report["best"], indent=1), flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
