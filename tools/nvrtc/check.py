#!/usr/bin/env python3
"""Compile-check (not run) an ``mx.fast.cuda_kernel`` kernel with NVRTC, as MLX 0.32.4's CUDA backend does.

Reproduces, without a GPU:
  * mlx/backend/cuda/custom_kernel.cpp ``build_kernel``: default header + user header +
    ``namespace mlx::core::cu { namespace cg = cooperative_groups; __global__ void custom_kernel_<name><hash>(...)``
    with ``const <T>* <in>`` params, ``const __grid_constant__ Shape <in>_shape`` / ``Strides <in>_strides`` /
    ``int <in>_ndim`` only where the *source* contains that substring (and the input has ndim > 0),
    ``<T>* <out>`` params, then ``constexpr int/bool`` / ``using`` lines for the template args, then the source.
  * mlx/backend/cuda/jit_module.cpp ``compile``: nvrtcCreateProgram with MLX's 17 embedded device
    headers (extracted from the wheel's libmlx.so into jit_headers/) as in-memory headers,
    nvrtcAddNameExpression("mlx::core::cu::custom_kernel_..."), options
    ``--device-as-default-execution-space --gpu-architecture=sm_90a`` (H100/H200: cc 9.0 -> sm_90 + "a")
    and --include-path for <mlx>/include, <mlx>/include/cccl, <site-packages>/nvidia/cu13/include.
    No -std flag (NVRTC's default, C++17).

Library use:  from check import compile_kernel
CLI:          python check.py spec SPEC.json [--dump DIR]      (see ``_spec_example`` below)
              python check.py project [--jobs 2] [--dump DIR]  (this repository's qmv_rows + rowkernel sweep)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = os.environ.get("NVRTC_WORK", "/tmp/nvrtc")  # the NVRTC wheels and extracted headers (tools/nvrtc/README.md)
NV = os.environ.get("NVRTC_NVIDIA_DIR", os.path.join(WORK, "pkgs", "nvidia", "cu13"))
MLX_ROOT = os.environ.get("MLX_CUDA_ROOT", "/tmp/mlxcuda/mlx")  # the unzipped mlx-cuda-13 wheel's mlx/
JIT_HEADERS = os.path.join(WORK, "jit_headers")  # extract_jit_headers.py output
ARCH = os.environ.get("NVRTC_ARCH", "sm_90a")

sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from workers.kernels import mlx_jit  # noqa: E402  (the repository's copy of MLX's build and compile)


def dtype_name(d) -> str:
    """'bfloat16' from 'bfloat16', 'mx.bfloat16' or an mlx Dtype object."""
    return mlx_jit.type_name(str(d).replace("mx.", ""))


@functools.lru_cache
def toolchain(arch: str = ARCH) -> mlx_jit.Toolchain:
    """MLX's compile setup from the unzipped wheel and the extracted headers (no GPU, no MLX CUDA)."""
    headers = {}
    for inc in mlx_jit.INCLUDE_NAMES:
        with open(os.path.join(JIT_HEADERS, inc), "rb") as f:
            headers[inc] = f.read()
    includes = [
        os.path.join(MLX_ROOT, "include"),
        os.path.join(MLX_ROOT, "include", "cccl"),
        os.path.join(NV, "include"),
    ]
    extra = os.environ.get("NVRTC_EXTRA", "").split()  # e.g. "--ptxas-options=-v": registers and spills in the log
    options = (
        "--device-as-default-execution-space",
        f"--gpu-architecture={arch}",
        *(f"--include-path={p}" for p in includes if os.path.isdir(p)),
        *extra,
    )
    lib = mlx_jit.load_nvrtc(mlx_jit.Path(NV) / "lib")
    return mlx_jit.Toolchain(lib, headers, options, arch.startswith("sm_"))


def nvrtc_version() -> str:
    import ctypes

    a, b = ctypes.c_int(), ctypes.c_int()
    toolchain().nvrtc.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
    return f"{a.value}.{b.value}"


def compile_kernel(name, inputs, output_names, output_dtypes, source, header="", template=(), dump=None, arch=ARCH):
    """Build as MLX does and compile. Returns dict(ok, log, seconds, kernel, detail)."""
    template = [(t, (v if isinstance(v, (bool, int)) else dtype_name(v))) for t, v in template]
    inputs = [(n, nd, dtype_name(dt)) for n, nd, dt in inputs]
    kname, src = mlx_jit.kernel_text(
        name, inputs, output_names, [dtype_name(d) for d in output_dtypes], source, header, template
    )
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, kname + ".cu"), "w") as f:
            f.write(src)
    t0 = time.perf_counter()
    try:
        binary, lowered, log = mlx_jit.compile_module(toolchain(arch), kname, src, kname)
    except RuntimeError as exc:
        return {"ok": False, "log": str(exc), "seconds": time.perf_counter() - t0, "kernel": kname, "detail": "failed"}
    secs = time.perf_counter() - t0
    out_dir = os.environ.get("NVRTC_CUBIN_DIR")  # keep the cubin (for cuobjdump -sass)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, kname + ".cubin"), "wb") as f:
            f.write(binary)
    return {"ok": True, "log": log, "seconds": secs, "kernel": kname, "detail": f"{lowered} cubin={len(binary)}B"}


def report(label, r):
    if r["ok"]:
        extra = f"  (log: {r['log'].strip()})" if r["log"].strip() else ""
        print(f"{label}: ok {r['seconds']:.1f}s  [{r['detail']}]{extra}", flush=True)
    else:
        print(f"{label}: FAILED {r['seconds']:.1f}s  [{r['detail']}]\n{r['log']}", flush=True)


# ---------------------------------------------------------------------------------------------------
# spec mode
_spec_example = {
    "name": "myk",
    "inputs": [["x", 2, "bfloat16"], ["w", 2, "uint32"]],
    "outputs": [["out", "bfloat16"]],
    "source": "...",
    "header": "...",  # or "source_file"/"header_file"
    "template": [["T", "bfloat16"], ["M", 1], ["FLAG", True]],  # strings are dtypes
}


def run_spec(path, dump):
    spec = json.load(open(path))
    src = spec.get("source") or open(spec["source_file"]).read()
    hdr = spec.get("header", "") if "header_file" not in spec else open(spec["header_file"]).read()
    r = compile_kernel(
        spec["name"],
        [tuple(i) for i in spec["inputs"]],
        [o[0] for o in spec["outputs"]],
        [o[1] for o in spec["outputs"]],
        src,
        hdr,
        [tuple(t) for t in spec.get("template", [])],
        dump,
    )
    report(r["kernel"], r)
    return 0 if r["ok"] else 1


# ---------------------------------------------------------------------------------------------------
# project mode: this repository's workers/kernels/qmv_source.py (qmv_rows' kernel) and workers/kernels/rowkernel.py
def project_cases():
    from workers.kernels import qmv_source, rowkernel, sdpa_rows, sdpa_source

    cases = []
    bf = "bfloat16"
    for count in (1, 2):
        if count == 1:
            ins = [("x", 2, bf), ("w", 2, "uint32"), ("scales", 2, bf), ("biases", 2, bf)]
            outs = ["out"]
            src = qmv_source.ONE + qmv_source.BODY
        else:
            ins = [("x", 2, bf)] + [
                (f"{n}{j}", 2, "uint32" if n == "w" else bf) for j in range(count) for n in ("w", "scales", "biases")
            ]
            outs = [f"out{j}" for j in range(count)]
            src = qmv_source.many(count) + qmv_source.BODY
        for bits in (4, 8):
            for m in (1, 5, 8):
                for u in (1, 2, 4):
                    tmpl = [("T", bf), ("M", m), ("GS", 64), ("BITS", bits), ("R", 4), ("U", u)]
                    label = f"qmv_rows count={count} BITS={bits} M={m} U={u}"
                    cases.append(
                        (
                            label,
                            dict(
                                name=f"mlx_batchd_qmv_rows_{count}",
                                inputs=ins,
                                output_names=outs,
                                output_dtypes=[bf] * len(outs),
                                source=src,
                                header=qmv_source.HEADER,
                                template=tmpl,
                            ),
                        )
                    )
    # rowkernel: quant (template T, M, R, BITS, GS, VEC) and dense (T, M, R)
    q_ins = [("x", 2, bf), ("w", 2, "uint32"), ("scales", 2, bf), ("biases", 2, bf)]
    for bits in (4, 8):
        for m in (1, 5, 8):
            for vec in (1, 4):
                tmpl = [("T", bf), ("M", m), ("R", rowkernel.OUTS_PER_WARP), ("BITS", bits), ("GS", 64), ("VEC", vec)]
                cases.append(
                    (
                        f"rowkernel quant BITS={bits} M={m} VEC={vec}",
                        dict(
                            name="mlx_batchd_rowwise_quant",
                            inputs=q_ins,
                            output_names=["out"],
                            output_dtypes=[bf],
                            source=rowkernel._QUANT_SOURCE,
                            header=rowkernel._HEADER,
                            template=tmpl,
                        ),
                    )
                )
    for m in (1, 5, 8):
        tmpl = [("T", bf), ("M", m), ("R", rowkernel.OUTS_PER_WARP)]
        cases.append(
            (
                f"rowkernel dense M={m}",
                dict(
                    name="mlx_batchd_rowwise_dense",
                    inputs=[("x", 2, bf), ("w", 2, bf)],
                    output_names=["out"],
                    output_dtypes=[bf],
                    source=rowkernel._DENSE_SOURCE,
                    header=rowkernel._HEADER,
                    template=tmpl,
                ),
            )
        )
    # sdpa_rows: one pass and the two passes, per dtype and head dimension
    for dt in ("bfloat16", "float16", "float32"):
        for dim in sdpa_rows.HEAD_DIMS:
            attn_ins = [("queries", 4, dt), ("keys", 4, dt), ("values", 4, dt), ("scale", 1, "float32")]
            parts = [
                ("one_pass", attn_ins, ["out"], [dt], sdpa_source.ONE_PASS),
                ("pass_1", attn_ins, ["partials", "sums", "maxs"], ["float32"] * 3, sdpa_source.PASS_1),
                (
                    "pass_2",
                    [(n, 5 - (n != "partials"), "float32") for n in ("partials", "sums", "maxs")],
                    ["out"],
                    [dt],
                    sdpa_source.PASS_2,
                ),
            ]
            for part, ins, outs, out_dtypes, src in parts:
                cases.append(
                    (
                        f"sdpa_rows {part} T={dt} D={dim}",
                        dict(
                            name=f"mlx_batchd_sdpa_rows_{part}",
                            inputs=ins,
                            output_names=outs,
                            output_dtypes=out_dtypes,
                            source=src,
                            header=sdpa_source.HEADER,
                            template=[("T", dt), ("D", dim)],
                        ),
                    )
                )
    # batch_attention: the masked one-query kernel, per dtype and head dimension
    from workers.kernels import batch_attention

    for dt in ("bfloat16", "float16", "float32"):
        for dim in batch_attention.HEAD_DIMS:
            cases.append(
                (
                    f"batch_attention T={dt} D={dim}",
                    dict(
                        name="mlx_batchd_batch_attention",
                        inputs=[
                            ("queries", 4, dt),
                            ("keys", 4, dt),
                            ("values", 4, dt),
                            ("mask", 2, "bool"),
                            ("scale", 1, "float32"),
                        ],
                        output_names=["out"],
                        output_dtypes=[dt],
                        source=batch_attention.SOURCE,
                        header=batch_attention.HEADER,
                        template=[("T", dt), ("D", dim)],
                    ),
                )
            )
    # w4a16: the native tiles (``w4a16.TILES``' shapes), split with and without the in-kernel reduction,
    # built as ``w4a16.launch`` builds them (name, template, pipeline depth from ``w4a16.plan``)
    from workers.kernels import w4a16

    kern = w4a16.NATIVE
    for dt, tiles in ((bf, ((1, 2), (2, 2), (4, 2), (8, 2), (8, 1), (2, 1), (4, 1))), ("float16", ((2, 2), (4, 2)))):
        w_ins = [("x", 2, dt), ("w", 2, "uint32"), ("scales", 2, dt), ("biases", 2, dt), ("locks", 1, "int32")]
        for mt, nb in tiles:
            p = w4a16.plan(16 * mt, 4096, 4096, mt=mt, nb=nb, splits=2)
            for gs in (32, 64):
                for red in (True, False):
                    mdt = getattr(__import__("mlx.core", fromlist=["core"]), dt)
                    cases.append(
                        (
                            f"w4a16 {'' if dt == bf else 'float16 '}MT={mt} NB={nb} GS={gs} REDUCE={int(red)}",
                            dict(
                                name=w4a16.kernel_name(kern, p, gs, True, red, mdt),
                                inputs=w_ins,
                                output_names=w4a16.OUTPUT_NAMES,
                                output_dtypes=[dt, "float32"],
                                source=kern.source,
                                header=kern.header,
                                template=[  # dtypes by name: the cases cross to worker processes
                                    (k, v if isinstance(v, (bool, int)) else dtype_name(v))
                                    for k, v in w4a16.template(kern, p, gs, True, red, mdt)
                                ],
                            ),
                        )
                    )
    # the dequantize kernel (``dequant_kernel``), each group size
    from workers.kernels import dequant_kernel

    for dt in ("bfloat16", "float16"):
        for gs in (32, 64, 128):
            cases.append(
                (
                    f"dequant {dt} GS={gs}",
                    dict(
                        name="mlx_batchd_dequant4",
                        inputs=[("w", 2, "uint32"), ("scales", 2, dt), ("biases", 2, dt)],
                        output_names=["out"],
                        output_dtypes=[dt],
                        source=dequant_kernel.SOURCE,
                        header=dequant_kernel.HEADER,
                        template=[("T", dt), ("GS", gs)],
                    ),
                )
            )
    return cases


def _run_case(args):
    label, kw, dump = args
    return label, compile_kernel(dump=dump, **kw)


def run_project(jobs, dump, only):
    cases = [c for c in project_cases() if not only or only in c[0]]
    print(f"NVRTC {nvrtc_version()} ({NV}/lib), arch {ARCH}, {len(cases)} kernels, {jobs} jobs", flush=True)
    fails = 0
    t0 = time.perf_counter()
    with ProcessPoolExecutor(jobs) as ex:
        for label, r in ex.map(_run_case, [(lbl, kw, dump) for lbl, kw in cases]):
            report(label, r)
            fails += not r["ok"]
    print(f"{len(cases) - fails} ok, {fails} failed, {time.perf_counter() - t0:.0f}s wall", flush=True)
    return 1 if fails else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("spec")
    a.add_argument("path")
    a.add_argument("--dump")
    b = sub.add_parser("project")
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--dump", help="write each generated .cu here")
    b.add_argument("--only", help="substring filter on case labels, e.g. 'qmv_rows count=1 BITS=4 M=1 '")
    args = ap.parse_args()
    if args.cmd == "spec":
        return run_spec(args.path, args.dump)
    return run_project(args.jobs, args.dump, args.only)


if __name__ == "__main__":
    sys.exit(main())
