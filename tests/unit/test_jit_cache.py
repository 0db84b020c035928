"""``workers.kernels.jit_cache`` and ``mlx_jit`` on the CPU: MLX's kernel text, its module names and cache paths, and a
cache that can't be written leaving the kernel to MLX (the GPU side: tests/gpu/test_jit_cache_gpu.py)."""

from __future__ import annotations

import ctypes.util
import logging
import random
from pathlib import Path
from typing import Any

import pytest

from workers.kernels import jit_cache, mlx_jit

MASK = (1 << 64) - 1


def _libstdcxx_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s ``_Hash_bytes`` for a 64-bit size_t (libsupc++/hash_bytes.cc), written out."""
    mul = (0xC6A4A793 << 32) + 0x5BD1E995

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    aligned = len(data) & ~7
    h = (seed ^ (len(data) * mul)) & MASK
    for i in range(0, aligned, 8):
        d = (shift_mix((int.from_bytes(data[i : i + 8], "little") * mul) & MASK) * mul) & MASK
        h = ((h ^ d) * mul) & MASK
    if len(data) & 7:
        tail = 0
        for b in reversed(data[aligned:]):
            tail = (tail << 8) + b
        h = ((h ^ tail) * mul) & MASK
    return shift_mix((shift_mix(h) * mul) & MASK)


@pytest.mark.skipif(ctypes.util.find_library("stdc++") is None, reason="libstdc++ (MLX CUDA's C++ runtime) absent")
def test_module_names_hash_the_text_as_libstdcxx_std_hash_does() -> None:
    rng = random.Random(3)
    texts = ["", "a", "hello", "x" * 8, "y" * 9, mlx_jit.DEFAULT_HEADER]
    texts += ["".join(rng.choice("ab{}();\n ") for _ in range(rng.randrange(1, 300))) for _ in range(40)]
    for text in texts:
        assert mlx_jit.std_hash(text) == _libstdcxx_hash(text.encode()), repr(text)


def test_kernel_text_is_mlx_build_kernel() -> None:
    """Template suffixes (bool, int, type), shape parameters only for the inputs the source names,
    and the ``constexpr``/``using`` lines, as MLX's ``build_kernel`` writes them."""
    kernel, text = mlx_jit.kernel_text(
        "k",
        [("x", 2, "bfloat16"), ("w", 2, "uint32"), ("s", 0, "float32")],
        ["out", "aux"],
        ["bfloat16", "float32"],
        "out[0] = x[x_strides[0]] + w_ndim + s_shape[0];",
        "// header\n",
        [("T", "bfloat16"), ("M", 5), ("SPLIT", True), ("RED", False)],
    )
    assert kernel == "custom_kernel_k_bfloat16_t_5_t_f"
    assert text == (
        mlx_jit.DEFAULT_HEADER
        + "// header\nnamespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        + "__global__ void custom_kernel_k_bfloat16_t_5_t_f(\n"
        + "    const __nv_bfloat16* x,\n    const __grid_constant__ Strides x_strides,\n"
        + "    const uint32_t* w,\n    const __grid_constant__ int w_ndim,\n"
        + "    const float* s,\n"
        + "    __nv_bfloat16* out,\n    float* aux) {\n"
        + "  using T = __nv_bfloat16;\n  constexpr int M = 5;\n  constexpr bool SPLIT = true;\n"
        + "  constexpr bool RED = false;\n\n"
        + "out[0] = x[x_strides[0]] + w_ndim + s_shape[0];\n}\n\n} // namespace mlx::core::cu\n"
    )


def test_a_module_name_over_245_characters_is_split_into_folders(tmp_path: Path) -> None:
    short = mlx_jit.module_file(tmp_path, "custom_kernel_k", "text")
    assert short == tmp_path / f"custom_kernel_k_{mlx_jit.std_hash('text'):x}.ptx"
    name = "custom_kernel_" + "n" * 600
    long = mlx_jit.module_file(tmp_path, name, "text")
    full = f"{name}_{mlx_jit.std_hash('text'):x}"
    assert long == tmp_path / full[:245] / full[245:490] / (full[490:] + ".ptx")
    suffix = f"_{mlx_jit.std_hash('text'):x}"
    for size in (245, 246):  # MLX splits only a name over 245 characters
        name = "k" * (size - len(suffix))
        expected = (
            tmp_path / (name + suffix + ".ptx")
            if size == 245
            else tmp_path / (name + suffix)[:245] / f"{(name + suffix)[245:]}.ptx"
        )
        assert mlx_jit.module_file(tmp_path, name, "text") == expected


def test_the_cache_folder_is_mlx_s(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "c"))
    assert mlx_jit.mlx_cache_dir("0.32.4") == tmp_path / "c"
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    for var in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TEMP", str(tmp_path))
    assert mlx_jit.mlx_cache_dir("0.32.4") == tmp_path / "mlx" / "0.32.4" / "ptx"


def test_a_written_module_has_mlx_s_names_file_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "d" / "custom_kernel_k_1f.ptx"
    mlx_jit.write_module(path, "custom_kernel_k", b"\x7fELF...", "_ZN3mlx4core2cu15custom_kernel_kEv")
    assert path.read_bytes() == b"\x7fELF..."
    assert (
        path.with_suffix(".txt").read_text() == "mlx::core::cu::custom_kernel_k\t_ZN3mlx4core2cu15custom_kernel_kEv\n"
    )
    assert sorted(p.name for p in path.parent.iterdir()) == ["custom_kernel_k_1f.ptx", "custom_kernel_k_1f.txt"]


class _Array:
    ndim = 2
    dtype = "bfloat16"


def _kernel(source: str = "out[0] = x[0];") -> object:
    """A kernel object as ``cuda_kernel`` registers it (MLX's own needs a CUDA back-end to be made)."""
    kernel = object()
    jit_cache.register(kernel, jit_cache.KernelSpec("k", ("x",), ("out",), source, ""))
    return kernel


def test_a_cache_that_cannot_be_written_leaves_the_kernel_to_mlx(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """One warning, nothing written, and no later variant tries again."""
    monkeypatch.setattr(jit_cache, "_state", {"cache": tmp_path})
    monkeypatch.setattr(jit_cache, "enabled", lambda: not jit_cache._state.get("off"))
    tries: list[int] = []

    def no_toolchain() -> mlx_jit.Toolchain:
        tries.append(1)
        raise RuntimeError("no NVRTC here")

    monkeypatch.setattr(mlx_jit, "toolchain", no_toolchain)
    kernel = _kernel()
    with caplog.at_level(logging.WARNING, logger="mlx_batchd"):
        for m in (1, 2, 3):
            assert jit_cache.prime(kernel, [_Array()], [("T", "bfloat16"), ("M", m)], ["bfloat16"]) is None
    assert tries == [1]
    assert [r.getMessage() for r in caplog.records] == [
        "project kernels are left to MLX's own compiling (not cached on disk): no NVRTC here"
    ]


def test_each_new_variant_is_compiled_into_the_cache_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A variant's first prime compiles it (here with a stand-in compiler: NVRTC needs the CUDA wheels)
    into the cache folder at its module name; later primes, and another kernel object in a later
    process finding the file, compile nothing."""
    compiled: list[str] = []

    def compile_module(tools: Any, kernel: str, text: str, module: str, extra: Any = ()) -> tuple[bytes, str, str]:
        compiled.append(kernel)
        return b"binary of " + kernel.encode(), "_Z" + kernel, ""

    tools = mlx_jit.Toolchain(None, {}, (), True)
    monkeypatch.setattr(jit_cache, "_state", {"tools": tools, "cache": tmp_path})
    monkeypatch.setattr(jit_cache, "enabled", lambda: True)
    monkeypatch.setattr(mlx_jit, "compile_module", compile_module)
    for _ in range(2):  # the second object stands for a later process
        kernel = _kernel()
        for m in (1, 2, 1):
            jit_cache.prime(kernel, [_Array()], [("T", "bfloat16"), ("M", m)], ["bfloat16"])
    assert compiled == ["custom_kernel_k_bfloat16_t_1", "custom_kernel_k_bfloat16_t_2"]
    _, text = mlx_jit.kernel_text(
        "k", [("x", 2, "bfloat16")], ["out"], ["bfloat16"], "out[0] = x[0];", "", [("T", "bfloat16"), ("M", 2)]
    )
    path = mlx_jit.module_file(tmp_path, "custom_kernel_k_bfloat16_t_2", text)
    assert path.read_bytes() == b"binary of custom_kernel_k_bfloat16_t_2"


def test_a_register_cap_in_the_template_reaches_nvrtc_and_has_its_own_module_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``MAXREG`` (``jit_cache.REGISTER_CAP``) above 0 adds ``--maxrregcount`` to NVRTC's options; 0 adds
    nothing; each cap is compiled into a file of its own (a cap never loads another cap's binary)."""
    calls: list[tuple[str, tuple[str, ...]]] = []

    def compile_module(tools: Any, kernel: str, text: str, module: str, extra: Any = ()) -> tuple[bytes, str, str]:
        calls.append((module, tuple(extra)))
        return b"binary", "_Z" + kernel, ""

    monkeypatch.setattr(jit_cache, "_state", {"tools": mlx_jit.Toolchain(None, {}, (), True), "cache": tmp_path})
    monkeypatch.setattr(jit_cache, "enabled", lambda: True)
    monkeypatch.setattr(mlx_jit, "compile_module", compile_module)
    kernel = _kernel()
    for cap in (0, 128, 168):
        jit_cache.prime(kernel, [_Array()], [("M", 1), (jit_cache.REGISTER_CAP, cap)], ["bfloat16"])
    assert [extra for _, extra in calls] == [(), ("--maxrregcount=128",), ("--maxrregcount=168",)]
    assert len({module for module, _ in calls}) == 3
    assert len(list(tmp_path.glob("*.ptx"))) == 3


def test_nothing_is_written_where_the_cache_is_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``MLX_BATCHD_KERNEL_CACHE=0`` on MLX CUDA (stood in for: this CPU has none) writes nothing; unset, it writes."""
    import mlx.core as mx

    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(jit_cache, "_state", {"tools": mlx_jit.Toolchain(None, {}, (), True), "cache": tmp_path})
    monkeypatch.setattr(mlx_jit, "compile_module", lambda *a: (b"binary", "_Zk", ""))
    monkeypatch.setenv("MLX_BATCHD_KERNEL_CACHE", "0")
    assert jit_cache.prime(_kernel(), [_Array()], [("M", 1)], ["bfloat16"]) is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv("MLX_BATCHD_KERNEL_CACHE")
    path = jit_cache.prime(_kernel(), [_Array()], [("M", 1)], ["bfloat16"])
    assert path is not None and path.read_bytes() == b"binary"


def test_the_compiler_is_the_nvrtc_the_process_already_loaded(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 1 /opt/x/lib/libnvrtc-builtins.so.13.0\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /opt/x/lib/libnvrtc.so.13\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n\n"
    )
    assert mlx_jit.loaded_library("libnvrtc.so", maps) == "/opt/x/lib/libnvrtc.so.13"
    assert mlx_jit.loaded_library("libcudart.so", maps) is None
    assert mlx_jit.loaded_library("libnvrtc.so", tmp_path / "absent") is None


def test_a_variant_already_in_the_cache_needs_no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A later process finds every variant written: it never loads NVRTC or reads MLX's headers."""
    monkeypatch.setattr(jit_cache, "_state", {"cache": tmp_path})
    monkeypatch.setattr(jit_cache, "enabled", lambda: True)

    def no_toolchain() -> mlx_jit.Toolchain:
        raise AssertionError("the toolchain was made for a variant already in the cache")

    monkeypatch.setattr(mlx_jit, "toolchain", no_toolchain)
    template = [("T", "bfloat16"), ("M", 3)]
    kernel_name, text = mlx_jit.kernel_text(
        "k", [("x", 2, "bfloat16")], ["out"], ["bfloat16"], "out[0] = x[0];", "", template
    )
    written = mlx_jit.module_file(tmp_path, kernel_name, text)
    mlx_jit.write_module(written, kernel_name, b"earlier", "_Zk")
    assert jit_cache.prime(_kernel(), [_Array()], template, ["bfloat16"]) == written
    assert not jit_cache._state.get("off")


@pytest.mark.parametrize(
    ("nvrtc", "cc", "sass"),
    [
        ((8, 0), (7, 0), False),
        ((9, 2), (7, 2), True),
        ((9, 2), (7, 5), False),
        ((10, 1), (7, 5), True),
        ((10, 1), (8, 0), False),
        ((11, 0), (8, 0), True),
        ((11, 0), (8, 6), False),
        ((11, 5), (8, 6), True),
        ((11, 5), (8, 9), False),
        ((13, 0), (9, 0), True),
    ],
)
def test_machine_code_or_ptx_is_chosen_as_mlx_chooses(nvrtc: tuple[int, int], cc: tuple[int, int], sass: bool) -> None:
    """MLX's ``compiler_supports_device_sass``: which NVRTC compiles a device's machine code (else PTX)."""
    assert mlx_jit._supports_sass(nvrtc, cc) is sass
