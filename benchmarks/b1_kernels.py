"""Device measurement: the kernels of a decode step against its wall (issue 54; B = 1 unless ``--batch``).

    nsys profile -t cuda --cuda-graph-trace=node -o b1k python benchmarks/b1_kernels.py --model "$M"
    nsys stats -r cuda_gpu_trace -f csv -o b1k b1k.nsys-rep
    python benchmarks/b1_kernels.py --summarize b1k_cuda_gpu_trace.csv

Runs ``Engine.step`` on one decoding sequence (the daemon's classic B = 1 decode: compiled layers, the
stored kernel plans), times ``--steps`` steps without a profiler, then runs the same number between two
marker kernels (``b1k_marker``) and with the CUDA profiler API started around them (for
``ncu --profile-from-start off``). ``--summarize`` reads the kernels between the markers from an Nsight
Systems GPU trace (or an Nsight Compute CSV of ``gpu__time_duration.sum``) and prints per step: kernels,
their summed time, the span from the first kernel's start to the last one's end, and the kernels by
name. Summed kernel time near the wall says the device sets the step; far below it, the host does.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

MARKER = "b1k_marker"


def _profiler(start: bool) -> str:
    """cudaProfilerStart/Stop through the CUDA runtime or driver library found first; what ran."""
    names: list[str] = []
    for p in sys.path:
        names += glob.glob(f"{p}/nvidia/*/lib/libcudart.so*") + glob.glob(f"{p}/nvidia/cuda_runtime/lib/libcudart.so*")
    for lib, fn in [
        *((n, "cudaProfiler") for n in names),
        ("libcudart.so", "cudaProfiler"),
        ("libcuda.so.1", "cuProfiler"),
    ]:
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        rc = getattr(handle, fn + ("Start" if start else "Stop"))()
        return f"{lib} {fn}{'Start' if start else 'Stop'} rc={rc}"
    return "no CUDA library found"


def _marker() -> None:
    import mlx.core as mx

    if not mx.cuda.is_available():
        return
    kernel = mx.fast.cuda_kernel(
        name=MARKER, input_names=["x"], output_names=["out"], source="out[threadIdx.x] = x[threadIdx.x] + 1;"
    )
    x = mx.zeros((32,), dtype=mx.float32)
    out = kernel(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)], output_dtypes=[mx.float32])
    mx.eval(out)
    mx.synchronize()


def run(model_path: str, steps: int, warm: int, batch: int, calibration: str) -> dict[str, Any]:
    import mlx.core as mx

    from workers.api import Job
    from workers.engine.engine import Engine
    from workers.kernels import install
    from workers.models.loading import load

    install()
    loaded = load(model_path)
    engine = Engine(
        loaded.model, calibration=calibration, eos_token_ids=(), vocab_size=loaded.info.vocab_size, max_batch=batch
    )
    for i in range(batch):
        prompt = [(5 * j + 7 * i) % 1000 + 3 for j in range(32)]
        engine.submit(Job(seq=i, prompt=prompt, max_tokens=warm + 3 * steps + 16))
    for _ in range(warm):
        engine.step()
    mx.synchronize()
    walls = []
    for _ in range(steps):
        tic = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - tic) * 1e3)
    _marker()
    started = _profiler(True)
    tic = time.perf_counter()
    for _ in range(steps):
        engine.step()
    mx.synchronize()
    profiled = (time.perf_counter() - tic) * 1e3 / steps
    stopped = _profiler(False)
    _marker()
    engine.cancel_all("cancelled")
    report = {
        "batch": batch,
        "kernel_plans": engine.kernel_plans,
        "steps": steps,
        "step_ms_median": round(statistics.median(walls), 3),
        "step_ms": [round(w, 3) for w in walls],
        "profiled_step_ms": round(profiled, 3),
        "profiler": [started, stopped],
    }
    print(json.dumps(report), flush=True)
    return report


def _rows(path: str) -> list[tuple[str, float, float]]:
    """(name, start ns, duration ns) per kernel, in launch order, from an nsys GPU trace or an ncu CSV."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.strip() and not line.startswith("==")]
    reader = csv.DictReader(lines)
    out: list[tuple[str, float, float]] = []
    for r in reader:
        if "Duration (ns)" in r:  # nsys cuda_gpu_trace
            name = r.get("Name") or ""
            if r.get("Start (ns)") and name and not name.startswith("[CUDA"):
                out.append((name, float(r["Start (ns)"]), float(r["Duration (ns)"])))
        elif r.get("Metric Name") == "gpu__time_duration.sum":  # ncu --csv
            unit = r.get("Metric Unit", "ns")
            value = float(r["Metric Value"].replace(",", "")) * {"ns": 1, "usecond": 1e3, "msecond": 1e6}.get(unit, 1)
            out.append((r["Kernel Name"], float("nan"), value))
    return out


def summarize(path: str, steps: int) -> dict[str, Any]:
    rows = _rows(path)
    marks = [i for i, r in enumerate(rows) if MARKER in r[0]]
    if len(marks) >= 2:
        rows = rows[marks[-2] + 1 : marks[-1]]
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, _, dur in rows:
        by_name[name[:90]].append(dur)
    starts = [s for _, s, _ in rows if s == s]
    span = (max(s + d for _, s, d in rows if s == s) - min(starts)) / 1e6 / steps if starts else None
    report = {
        "kernels_a_step": round(len(rows) / steps, 1),
        "kernel_ms_a_step": round(sum(d for *_, d in rows) / 1e6 / steps, 3),
        "span_ms_a_step": None if span is None else round(span, 3),
        "markers_found": len(marks),
        "by_name": sorted(
            (
                (n, len(v) / steps, round(sum(v) / 1e3 / steps, 1), round(statistics.median(v) / 1e3, 2))
                for n, v in by_name.items()
            ),
            key=lambda t: -t[2],
        )[:40],
    }
    print(
        f"kernels a step {report['kernels_a_step']}, kernel time {report['kernel_ms_a_step']} ms, span {report['span_ms_a_step']} ms"
    )
    print("| kernel | calls a step | us a step | median us |")
    for n, c, us, med in report["by_name"]:
        print(f"| {n} | {c:g} | {us} | {med} |")
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warm", type=int, default=40)
    ap.add_argument("--batch", type=int, default=1, help="decoding sequences (the probe's name is for its first use)")
    ap.add_argument(
        "--calibration",
        choices=("now", "background"),
        default="now",
        help="background: the stored kernel plans or none (projections as mlx-lm calls them), nothing timed",
    )
    ap.add_argument("--summarize", help="an nsys cuda_gpu_trace CSV or an ncu --csv file")
    ap.add_argument("--out")
    a = ap.parse_args()
    report = summarize(a.summarize, a.steps) if a.summarize else run(a.model, a.steps, a.warm, a.batch, a.calibration)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
