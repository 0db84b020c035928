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
import ctypes
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

# mlx/backend/cuda/jit_module.cpp g_include_names (same order); contents are MLX's jit_source_* strings.
INCLUDE_NAMES = [
    "mlx/backend/cuda/device/" + n
    for n in (
        "atomic_ops.cuh",
        "binary_ops.cuh",
        "cast_op.cuh",
        "config.h",
        "complex.cuh",
        "cute_dequant.cuh",
        "fp16_math.cuh",
        "gemm_sm70.cuh",
        "hadamard.cuh",
        "indexing.cuh",
        "qmm_naive.cuh",
        "qmm_sm80.cuh",
        "qmm_sm90.cuh",
        "scatter_ops.cuh",
        "unary_ops.cuh",
        "ternary_ops.cuh",
        "utils.cuh",
    )
]

DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'

# mlx/backend/cuda/utils.cpp dtype_to_cuda_type / mlx/backend/common/compiled.cpp get_type_string
CUDA_TYPE = {
    "bool": "bool",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
    "float64": "double",
    "complex64": "mlx::core::cu::complex64_t",
}
TYPE_STRING = {
    "float32": "float",
    "float16": "float16_t",
    "bfloat16": "bfloat16_t",
    "float64": "double",
    "complex64": "complex64_t",
    "bool": "bool",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
}


def dtype_name(d) -> str:
    """'bfloat16' from 'bfloat16', 'mx.bfloat16' or an mlx Dtype object."""
    s = str(d)
    for p in ("mlx.core.", "mx.", "Dtype."):
        s = s.replace(p, "")
    if s not in CUDA_TYPE:
        raise ValueError(f"unknown dtype {d!r}")
    return s


class Dtype(str):
    """Marks a template argument as a dtype (plain str values in a spec are dtypes too)."""


def _is_dtype(v) -> bool:
    return not isinstance(v, (bool, int)) and (isinstance(v, str) or type(v).__name__ == "Dtype")


def build_kernel(name, inputs, output_names, output_dtypes, source, header, template):
    """MLX's build_kernel. inputs: [(name, ndim, dtype)]; template: [(name, int|bool|dtype)].
    Returns (kernel_name, source)."""
    h = ""
    for _, arg in template:
        if isinstance(arg, bool):
            h += "_t" if arg else "_f"
        elif isinstance(arg, int):
            h += f"_{arg}"
        else:
            h += "_" + TYPE_STRING[dtype_name(arg)]
    kname = "custom_kernel_" + name + h
    s = DEFAULT_HEADER + header
    s += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    s += "__global__ void " + kname + "(\n"
    for iname, ndim, dt in inputs:
        s += "    const " + CUDA_TYPE[dtype_name(dt)] + "* " + iname + ",\n"
        if ndim > 0:
            # custom_kernel.cpp: shape_infos from plain substring search over the source
            if (iname + "_shape") in source:
                s += "    const __grid_constant__ Shape " + iname + "_shape,\n"
            if (iname + "_strides") in source:
                s += "    const __grid_constant__ Strides " + iname + "_strides,\n"
            if (iname + "_ndim") in source:
                s += "    const __grid_constant__ int " + iname + "_ndim,\n"
    for i, (oname, dt) in enumerate(zip(output_names, output_dtypes)):
        s += "    " + CUDA_TYPE[dtype_name(dt)] + "* " + oname
        s += ",\n" if i < len(output_names) - 1 else ") {\n"
    if template:
        for tname, arg in template:
            if isinstance(arg, bool):
                s += f"  constexpr bool {tname} = {'true' if arg else 'false'};\n"
            elif isinstance(arg, int):
                s += f"  constexpr int {tname} = {arg};\n"
            else:
                s += f"  using {tname} = {CUDA_TYPE[dtype_name(arg)]};\n"
        s += "\n"
    s += source
    s += "\n}\n\n} // namespace mlx::core::cu\n"
    return kname, s


_lib = None


def nvrtc():
    global _lib
    if _lib is None:
        libdir = os.path.join(NV, "lib")
        builtins = sorted(f for f in os.listdir(libdir) if f.startswith("libnvrtc-builtins.so"))
        for b in builtins:  # libnvrtc dlopens its builtins library; preload it from the wheel
            ctypes.CDLL(os.path.join(libdir, b), mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(os.path.join(libdir, "libnvrtc.so.13"), mode=ctypes.RTLD_GLOBAL)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcCreateProgram.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(ctypes.c_char_p),
        ]
        lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcAddNameExpression.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetProgramLogSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcGetCUBINSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        _lib = lib
    return _lib


def nvrtc_version() -> str:
    a, b = ctypes.c_int(), ctypes.c_int()
    nvrtc().nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
    return f"{a.value}.{b.value}"


def _check(err, what):
    if err != 0:
        raise RuntimeError(f"{what} failed: {nvrtc().nvrtcGetErrorString(err).decode()}")


def include_args():
    args = [f"--include-path={os.path.join(MLX_ROOT, 'include')}"]
    cccl = os.path.join(MLX_ROOT, "include", "cccl")
    if os.path.isdir(cccl):
        args.append(f"--include-path={cccl}")
    args.append(f"--include-path={os.path.join(NV, 'include')}")
    return args


def compile_source(kernel_name: str, source: str, module_name: str = "check", arch: str = ARCH):
    """MLX's jit_module.cpp compile(). Returns (ok, log, seconds, detail)."""
    lib = nvrtc()
    headers = []
    for inc in INCLUDE_NAMES:
        with open(os.path.join(JIT_HEADERS, inc), "rb") as f:
            headers.append(f.read())
    n = len(headers)
    hdr_arr = (ctypes.c_char_p * n)(*headers)
    name_arr = (ctypes.c_char_p * n)(*[i.encode() for i in INCLUDE_NAMES])
    prog = ctypes.c_void_p()
    _check(
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), (module_name + ".cu").encode(), n, hdr_arr, name_arr
        ),
        "nvrtcCreateProgram",
    )
    full_name = ("mlx::core::cu::" + kernel_name).encode()
    _check(lib.nvrtcAddNameExpression(prog, full_name), "nvrtcAddNameExpression")
    # NVRTC_EXTRA: more options, e.g. "--ptxas-options=-v" (registers and spills of each kernel in the log)
    extra = os.environ.get("NVRTC_EXTRA", "").split()
    opts = ["--device-as-default-execution-space", f"--gpu-architecture={arch}", *include_args(), *extra]
    opt_arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    t0 = time.perf_counter()
    res = lib.nvrtcCompileProgram(prog, len(opts), opt_arr)
    secs = time.perf_counter() - t0
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value + 1)
    lib.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode(errors="replace")
    detail = ""
    if res == 0:
        lowered = ctypes.c_char_p()
        _check(lib.nvrtcGetLoweredName(prog, full_name, ctypes.byref(lowered)), "nvrtcGetLoweredName")
        cubin = ctypes.c_size_t()
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)), "nvrtcGetCUBINSize")
        detail = f"{lowered.value.decode()} cubin={cubin.value}B"
        out_dir = os.environ.get("NVRTC_CUBIN_DIR")  # keep the cubin (for cuobjdump -sass)
        if out_dir:
            data = ctypes.create_string_buffer(cubin.value)
            _check(lib.nvrtcGetCUBIN(prog, data), "nvrtcGetCUBIN")
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, kernel_name + ".cubin"), "wb") as f:
                f.write(data.raw)
    else:
        detail = lib.nvrtcGetErrorString(res).decode()
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return res == 0, log, secs, detail


def compile_kernel(name, inputs, output_names, output_dtypes, source, header="", template=(), dump=None, arch=ARCH):
    """Build as MLX does and compile. Returns dict(ok, log, seconds, kernel, detail)."""
    template = [(t, (v if isinstance(v, (bool, int)) else dtype_name(v))) for t, v in template]
    kname, src = build_kernel(name, inputs, output_names, output_dtypes, source, header, template)
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, kname + ".cu"), "w") as f:
            f.write(src)
    ok, log, secs, detail = compile_source(kname, src, kname, arch)
    return {"ok": ok, "log": log, "seconds": secs, "kernel": kname, "detail": detail}


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
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
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
    return cases


def _run_case(args):
    label, kw, dump = args
    return label, compile_kernel(dump=dump, **kw)


def run_project(jobs, dump, only):
    cases = [c for c in project_cases() if not only or only in c[0]]
    print(
        f"NVRTC {nvrtc_version()} ({NV}/lib/libnvrtc.so.13), arch {ARCH}, {len(cases)} kernels, {jobs} jobs", flush=True
    )
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
