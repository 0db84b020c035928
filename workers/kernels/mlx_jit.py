"""MLX CUDA's run-time compiling of ``mx.fast.cuda_kernel``, reproduced: the kernel text it builds,
the module name and cache file it reads, the device headers it embeds, NVRTC with its options.

Written from MLX 0.32's ``custom_kernel.cpp`` (``build_kernel``, the module name) and
``jit_module.cpp`` (``compile``, ``read_cached_ptx``/``write_cached_ptx``); ``jit_cache`` uses it to
write the project's kernels where MLX looks for them, ``tools/nvrtc/check.py`` to compile-check them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.kernels.backend import KERNEL_CACHE_ENV

#: ``mlx/backend/cuda/jit_module.cpp``'s in-memory device headers, in its order.
INCLUDE_NAMES = tuple(
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
)
#: The MLX versions whose kernel text, module names and cache files this module reproduces.
MLX_VERSIONS = re.compile(r"0\.32\.\d+$")

DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
#: MLX's ``dtype_to_cuda_type`` (parameters, ``using`` lines) and ``get_type_string`` (kernel names).
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
TYPE_STRING = {**CUDA_TYPE, "float16": "float16_t", "bfloat16": "bfloat16_t", "complex64": "complex64_t"}

TemplateArg = bool | int | str


def type_name(dtype: Any) -> str:
    """``"bfloat16"`` for ``mx.bfloat16`` (or for the name itself)."""
    name = str(dtype).removeprefix("mlx.core.")
    if name not in CUDA_TYPE:
        raise ValueError(f"no CUDA type for {dtype!r}")
    return name


def kernel_text(
    name: str,
    inputs: Sequence[tuple[str, int, str]],
    output_names: Sequence[str],
    output_types: Sequence[str],
    source: str,
    header: str,
    template: Sequence[tuple[str, TemplateArg]],
) -> tuple[str, str]:
    """MLX's ``build_kernel``: (kernel name, translation unit) for ``inputs`` as (name, ndim, type
    name) and template arguments (a type as its name). An input's shape, strides and ndim become
    parameters where the source names them (MLX's plain substring test)."""
    suffix = "".join(
        ("_t" if v else "_f") if isinstance(v, bool) else f"_{v}" if isinstance(v, int) else "_" + TYPE_STRING[v]
        for _, v in template
    )
    kernel = f"custom_kernel_{name}{suffix}"
    lines = [DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"]
    lines.append(f"__global__ void {kernel}(\n")
    for arg, ndim, dtype in inputs:
        lines.append(f"    const {CUDA_TYPE[dtype]}* {arg},\n")
        if ndim > 0:
            for part, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if arg + part in source:
                    lines.append(f"    const __grid_constant__ {kind} {arg}{part},\n")
    for i, (arg, dtype) in enumerate(zip(output_names, output_types, strict=True)):
        lines.append(f"    {CUDA_TYPE[dtype]}* {arg}" + (",\n" if i < len(output_names) - 1 else ") {\n"))
    for arg, v in template:
        if isinstance(v, bool):
            lines.append(f"  constexpr bool {arg} = {'true' if v else 'false'};\n")
        elif isinstance(v, int):
            lines.append(f"  constexpr int {arg} = {v};\n")
        else:
            lines.append(f"  using {arg} = {CUDA_TYPE[v]};\n")
    if template:
        lines.append("\n")
    lines.append(source + "\n}\n\n} // namespace mlx::core::cu\n")
    return kernel, "".join(lines)


def std_hash(text: str) -> int:
    """libstdc++'s ``std::hash<std::string>`` of ``text`` (what MLX names a kernel's module by)."""
    data = text.encode()
    return int(_hash_bytes()(data, len(data), 0xC70F6907))


def module_file(cache: Path, kernel: str, text: str) -> Path:
    """Where MLX looks for the module of ``kernel`` built from ``text`` (its ``get_ptx_path``: a name
    over 245 characters is split into folders)."""
    name = f"{kernel}_{std_hash(text):x}"
    path = cache
    while len(name) > 245:
        path, name = path / name[:245], name[245:]
    return path / (name + ".ptx")


def mlx_cache_dir(version: str) -> Path:
    """MLX's ``ptx_cache_dir``: ``MLX_PTX_CACHE_DIR``, else ``<temp>/mlx/<version>/ptx``."""
    if os.environ.get(KERNEL_CACHE_ENV):
        return Path(os.environ[KERNEL_CACHE_ENV])
    temp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(v)), "/tmp")
    return Path(temp) / "mlx" / version / "ptx"


def embedded_headers(library: Path) -> dict[str, bytes]:
    """MLX's device headers as its CUDA library embeds them (``jit_source_<name>`` symbols), by the
    names ``INCLUDE_NAMES`` gives them."""
    from elftools.elf.elffile import ELFFile

    wanted = {Path(n).stem: n for n in INCLUDE_NAMES}
    out: dict[str, bytes] = {}
    with library.open("rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")
        if symtab is None:
            raise RuntimeError(f"{library} has no symbol table")
        names = elf.get_section(symtab["sh_link"]).data()
        starts = {}
        for m in re.finditer(rb"_ZN3mlx4coreL\d+jit_source_(\w+?)E\0", names):
            stem = m.group(1).decode()
            if stem in wanted:
                starts[m.start()] = stem
        for st_name, _, _, shndx, value, size in struct.iter_unpack("<IBBHQQ", symtab.data()):
            stem = starts.get(st_name)
            if stem is None:
                continue
            section = elf.get_section(shndx)
            f.seek(section["sh_offset"] + value - section["sh_addr"])
            out[wanted[stem]] = f.read(size).rstrip(b"\0")
    missing = set(INCLUDE_NAMES) - set(out)
    if missing:
        raise RuntimeError(f"{library} embeds no {sorted(missing)[0]}")
    return out


@dataclass(frozen=True)
class Toolchain:
    """What compiling a kernel as this process's MLX does takes: NVRTC, the headers, the options."""

    nvrtc: Any
    headers: dict[str, bytes]
    options: tuple[str, ...]
    sass: bool


def supported_version() -> str:
    """This process's MLX version; ``RuntimeError`` where it is not one whose layout is reproduced."""
    import mlx.core as mx

    version = str(getattr(mx, "__version__", ""))
    if not MLX_VERSIONS.match(version):
        raise RuntimeError(f"MLX {version}: its kernel cache layout is not the one reproduced")
    return version


def toolchain() -> Toolchain:
    """This process's MLX CUDA's compiler setup (``RuntimeError`` where it is not the one reproduced)."""
    import mlx.core as mx

    supported_version()
    root = Path(mx.__file__).resolve().parent  # mlx/: lib/libmlx.so, include/
    nvidia = root.parent / "nvidia" / "cu13"
    lib = load_nvrtc(nvidia / "lib")
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    info = mx.device_info()
    cc = (int(info["compute_capability_major"]), int(info["compute_capability_minor"]))
    sass = _supports_sass((major.value, minor.value), cc)
    arch = f"--gpu-architecture={'sm' if sass else 'compute'}_{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''}"
    includes = [root / "include", root / "include" / "cccl"]
    cuda = nvidia / "include"
    if not cuda.exists():
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        cuda = Path(home) / "include"
    options = (
        "--device-as-default-execution-space",
        arch,
        *(f"--include-path={p}" for p in [*includes, cuda] if p.exists()),
    )
    headers = embedded_headers(root / "lib" / "libmlx.so")
    return Toolchain(lib, headers, options, sass)


def compile_module(
    tools: Toolchain, kernel: str, text: str, module: str, extra: Sequence[str] = ()
) -> tuple[bytes, str, str]:
    """NVRTC on ``text`` as MLX's ``compile`` (``extra``: options after MLX's own): (cubin or PTX, the
    kernel's lowered name, NVRTC's log); ``RuntimeError`` with the log where it does not compile."""
    lib = tools.nvrtc
    names = [n.encode() for n in INCLUDE_NAMES]
    n = len(names)
    prog = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(prog),
            text.encode(),
            (module + ".cu").encode(),
            n,
            (ctypes.c_char_p * n)(*(tools.headers[i] for i in INCLUDE_NAMES)),
            (ctypes.c_char_p * n)(*names),
        ),
    )
    try:
        full = f"mlx::core::cu::{kernel}".encode()
        _check(lib, lib.nvrtcAddNameExpression(prog, full))
        opts = [o.encode() for o in (*tools.options, *extra)]
        failed = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
        compile_log = buf.value.decode(errors="replace")
        if failed:
            raise RuntimeError(f"NVRTC: {compile_log.strip()[:2000]}")
        lowered = ctypes.c_char_p()
        _check(lib, lib.nvrtcGetLoweredName(prog, full, ctypes.byref(lowered)))
        mangled = (lowered.value or b"").decode()
        get_size, get = (
            (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if tools.sass else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        )
        size = ctypes.c_size_t()
        _check(lib, get_size(prog, ctypes.byref(size)))
        data = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, data))
        return data.raw, mangled, compile_log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def write_module(path: Path, kernel: str, binary: bytes, mangled: str) -> None:
    """MLX's ``write_cached_ptx`` files, each written whole before it appears under its name (the
    names file first: MLX reads the binary's presence as the entry's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, data in ((path.with_suffix(".txt"), f"mlx::core::cu::{kernel}\t{mangled}\n".encode()), (path, binary)):
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")  # created new, never followed
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)


def _supports_sass(nvrtc: tuple[int, int], cc: tuple[int, int]) -> bool:
    """MLX's ``compiler_supports_device_sass``."""
    if nvrtc < (9, 0):
        return False
    if nvrtc < (10, 0):
        return cc <= (7, 2)
    if nvrtc < (11, 0):
        return cc <= (7, 5)
    if nvrtc == (11, 0):
        return cc <= (8, 0)
    if nvrtc < (11, 8):
        return cc <= (8, 6)
    return True


def loaded_library(stem: str, maps: Path = Path("/proc/self/maps")) -> str | None:
    """The path of the ``stem`` library (e.g. ``libnvrtc.so``) this process has loaded, if any."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    paths = (fields[5] for fields in map(str.split, lines) if len(fields) >= 6)
    return next((path for path in paths if Path(path).name.startswith(stem + ".")), None)


def load_nvrtc(libdir: Path) -> Any:
    """The NVRTC this process's MLX loaded, else the one in the CUDA wheels beside MLX (its builtins
    first, which it loads by name), else the system's: one compiler for MLX and for this module."""
    path = loaded_library("libnvrtc.so")
    if path is None:
        for builtins in sorted(libdir.glob("libnvrtc-builtins.so*")):
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        found = sorted(libdir.glob("libnvrtc.so*"))
        path = str(found[-1]) if found else "libnvrtc.so.13"
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
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
    for size in ("nvrtcGetProgramLogSize", "nvrtcGetCUBINSize", "nvrtcGetPTXSize"):
        getattr(lib, size).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    for get in ("nvrtcGetProgramLog", "nvrtcGetCUBIN", "nvrtcGetPTX"):
        getattr(lib, get).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    return lib


def _check(lib: Any, err: int) -> None:
    if err != 0:
        raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(err).decode()}")


@functools.cache
def _hash_bytes() -> Any:
    fn = ctypes.CDLL("libstdc++.so.6")._ZSt11_Hash_bytesPKvmm
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return fn
