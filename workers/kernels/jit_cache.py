"""The project's own CUDA kernels, written to MLX's disk cache of compiled kernels, so a process
compiles each one once per machine instead of once per process.

MLX CUDA compiles every ``mx.fast.cuda_kernel`` with NVRTC in each process and never writes it to its
disk cache (its custom-kernel primitive asks for none), yet it reads ``<cache>/<module>.ptx`` and
``.txt`` before compiling any module. The project makes its kernels with ``cuda_kernel`` and calls
``prime`` before a new variant's first call (template arguments and types): the variant is compiled
here as MLX would compile it (its kernel text, its embedded device headers, its NVRTC options) and
written there (``mlx_jit`` reproduces MLX's side); MLX then loads that file, and every later process
too. Anything unexpected (another MLX layout, no NVRTC, no headers) turns the writing off for the
process and leaves the compiling to MLX, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.kernels import mlx_jit

log = logging.getLogger("mlx_batchd")


@dataclass
class KernelSpec:
    """What MLX builds a kernel's text from (``mx.fast.cuda_kernel``'s arguments), and the variants
    (template arguments) already written or found."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str
    seen: set[tuple[Any, ...]] = field(default_factory=set)

    def write(
        self, inputs: Sequence[Any], template: Sequence[tuple[str, Any]], output_dtypes: Sequence[Any]
    ) -> Path | None:
        """Compile this variant into MLX's cache unless it is there; its file, or ``None`` where the
        writing is off."""
        cache = _cache()
        if cache is None:
            return None
        try:
            args = [(n, v if isinstance(v, (bool, int)) else mlx_jit.type_name(v)) for n, v in template]
            specs = [(n, a.ndim, mlx_jit.type_name(a.dtype)) for n, a in zip(self.input_names, inputs, strict=True)]
            types = [mlx_jit.type_name(d) for d in output_dtypes]
            kernel, text = mlx_jit.kernel_text(
                self.name, specs, self.output_names, types, self.source, self.header, args
            )
            path = mlx_jit.module_file(cache, kernel, text)
            if path.exists():  # an earlier process's: no compiler needed
                return path
            tools = _tools()
            if tools is None:
                return None
            binary, mangled, _ = mlx_jit.compile_module(tools, kernel, text, path.stem, options(template))
            mlx_jit.write_module(path, kernel, binary, mangled)
            return path
        except Exception as exc:  # never in the way of MLX compiling it itself
            _disable(f"{self.name}: {exc}")
            return None


#: A template argument of this name (an int above 0) caps the kernel's registers a thread where the
#: project compiles it (NVRTC's ``--maxrregcount``); being in the template, it is in the kernel's text,
#: so each cap has its own module file. MLX's own compile (the writing off) ignores it.
REGISTER_CAP = "MAXREG"


def options(template: Sequence[tuple[str, Any]]) -> tuple[str, ...]:
    """NVRTC options a variant's template asks for beyond MLX's own (``REGISTER_CAP``)."""
    return tuple(f"--maxrregcount={v}" for n, v in template if n == REGISTER_CAP and isinstance(v, int) and v > 0)


#: Each kernel ``cuda_kernel`` made (kept alive here, so its id stays its own) and its spec.
_specs: dict[int, tuple[Any, KernelSpec]] = {}


def cuda_kernel(
    *, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str, header: str = "", **kwargs: Any
) -> Any:
    """``mx.fast.cuda_kernel``, its arguments kept so that ``prime`` can write its variants to MLX's cache."""
    import mlx.core as mx

    kernel = mx.fast.cuda_kernel(
        name=name, input_names=input_names, output_names=output_names, source=source, header=header, **kwargs
    )
    register(kernel, KernelSpec(name, tuple(input_names), tuple(output_names), source, header))
    return kernel


def register(kernel: Any, spec: KernelSpec) -> None:
    """``kernel`` made from ``spec`` (``cuda_kernel`` does it)."""
    _specs[id(kernel)] = (kernel, spec)


def prime(
    kernel: Any, inputs: Sequence[Any], template: Sequence[tuple[str, Any]], output_dtypes: Sequence[Any]
) -> Path | None:
    """Before ``kernel``'s call on ``inputs`` with ``template``: where this variant is new to the process
    and the writing is ``enabled``, compile it into MLX's cache unless it is there, so MLX loads it from
    there. A call site primes where it first works out a variant's launch arguments, not on every call.
    Returns the module's file (``None``: seen before, or not written)."""
    entry = _specs.get(id(kernel))
    if entry is None:
        return None
    spec = entry[1]
    key = tuple(template)
    if key in spec.seen:
        return None
    spec.seen.add(key)  # a variant of other input types keeps MLX's own compile
    return spec.write(inputs, template, output_dtypes) if enabled() else None


_state: dict[str, Any] = {}
_lock = threading.Lock()


def enabled() -> bool:
    """Whether kernels are written to MLX's cache here: MLX CUDA, and ``MLX_BATCHD_KERNEL_CACHE``
    not ``0``."""
    from workers.envs import KERNEL_CACHE, read

    if read(KERNEL_CACHE) == "0" or _state.get("off"):
        return False
    import mlx.core as mx

    return bool(mx.cuda.is_available())


def _cache() -> Path | None:
    """MLX's cache folder as MLX reads it (once: MLX reads it at its first compile)."""
    return _once("cache", lambda: mlx_jit.mlx_cache_dir(mlx_jit.supported_version()))


def _tools() -> mlx_jit.Toolchain | None:
    """NVRTC, MLX's headers and options, made at the first compile (a process whose variants are all
    in the cache never reads the headers out of MLX's library)."""
    return _once("tools", mlx_jit.toolchain)


def _once(key: str, make: Callable[[], Any]) -> Any:
    """``_state[key]``, made by ``make`` at the first call; ``None`` once the writing is off (a ``make``
    that fails turns it off)."""
    with _lock:
        if key not in _state and not _state.get("off"):
            try:
                _state[key] = make()
            except Exception as exc:
                _disable(str(exc))
        return _state.get(key)


def _disable(why: str) -> None:
    if not _state.get("off"):
        log.warning("project kernels are left to MLX's own compiling (not cached on disk): %s", why)
    _state["off"] = True
    _state.pop("tools", None)
    _state.pop("cache", None)
