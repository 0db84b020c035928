"""Every ``MLX_BATCHD_*`` environment variable the engine reads, declared once: name, default, purpose.

The engine reads them only through this module. A value that is not one of a variable's own is an
operator's typo, refused in one line (``SettingError``) before anything starts. No MLX import, so
the front end may read the registry too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


class SettingError(ValueError):
    """A process setting read from the environment (``MLX_BATCHD_*``) that is not one of its values:
    written for the operator, reported in one line before anything starts."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    #: The value where the variable is unset or empty.
    default: str
    #: Its values, where it takes only a few (``None``: free text).
    choices: tuple[str, ...] | None = None


#: Where generated state lives (verdicts, kernel plans, file hashes, converted GGUF files).
CACHE = EnvVar("MLX_BATCHD_CACHE", str(Path.home() / ".cache" / "mlx-batchd"))
#: The batched kernel policy (``workers.kernels.fastpath``): empty picks it by device; ``off`` is stock
#: mlx-lm (for comparison), ``cuda`` runs the CUDA policy anywhere (tests on CPU).
FASTPATH = EnvVar("MLX_BATCHD_FASTPATH", "", ("", "off", "generic", "cuda"))
#: Overrides the policy's compiled decoder layers (``workers.kernels.compiled_layers``): ``1`` runs them on
#: CPU for the tests that check the CUDA policy's compiled path serves exactly.
COMPILED_LAYERS = EnvVar("MLX_BATCHD_COMPILED_LAYERS", "", ("", "0", "1"))
#: The row-exact kernel (``workers.kernels.rowkernel``): empty picks CUDA where MLX runs on it; ``reference``
#: is its plain-MLX twin (CPU tests), ``off`` leaves the ``rowwise`` rung off the ladder.
ROWKERNEL = EnvVar("MLX_BATCHD_ROWKERNEL", "", ("", "off", "reference", "cuda"))
#: The w4a16 tensor-core kernel for batched decode's 4-bit projections (``workers.kernels.w4a16``): offered
#: to the plans on MLX CUDA unless ``0`` (calibration still picks it only where it is faster).
W4A16 = EnvVar("MLX_BATCHD_W4A16", "", ("", "0", "1"))
#: Large batches through a transient dequantized weight (``workers.kernels.dequant_matmul``): offered to the
#: plans on MLX CUDA unless ``0`` (calibration still picks it only where it is faster).
DEQUANT = EnvVar("MLX_BATCHD_DEQUANT", "", ("", "0", "1"))
#: Batched decode's attention through the project's masked one-query kernel (``workers.kernels.batch_attention``)
#: on MLX CUDA: ``1`` turns it on (off by default: through the daemon it did not beat MLX's masked path).
BATCH_ATTENTION = EnvVar("MLX_BATCHD_BATCH_ATTENTION", "", ("", "0", "1"))
#: ``0``: the project's CUDA kernels are not written to MLX's disk cache of compiled kernels
#: (``workers.kernels.jit_cache``), so each process compiles them again, as MLX alone does.
KERNEL_CACHE = EnvVar("MLX_BATCHD_KERNEL_CACHE", "", ("", "0", "1"))
#: A folder: the engine loop runs under cProfile and writes its profile there (device runs).
PROFILE_DIR = EnvVar("MLX_BATCHD_PROFILE_DIR", "")
#: Test seams (``workers.engine.faults``), e.g. ``request_token=257,engine_loop_after=40``.
TEST_FAULTS = EnvVar("MLX_BATCHD_TEST_FAULTS", "")
#: ``1``: once a verdict is reached, every forward runs at its level, the process-wide pin that
#: scoped pins replace. Only the bench sets it, for its arm that shows what scoping saves.
BENCH_PROCESS_PIN = EnvVar("MLX_BATCHD_BENCH_PROCESS_PIN", "", ("", "0", "1"))

ALL = (
    CACHE,
    FASTPATH,
    COMPILED_LAYERS,
    ROWKERNEL,
    W4A16,
    DEQUANT,
    BATCH_ATTENTION,
    KERNEL_CACHE,
    PROFILE_DIR,
    TEST_FAULTS,
    BENCH_PROCESS_PIN,
)


def read(var: EnvVar) -> str:
    """The variable's value (its default where unset or empty); ``SettingError`` for one that is not
    among its ``choices``."""
    value = os.environ.get(var.name) or var.default
    if var.choices is not None and value not in var.choices:
        named = [c for c in var.choices if c]
        expected = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " or " + named[-1]
        raise SettingError(f"{var.name}={value!r}: expected {expected}")
    return value


def switch(var: EnvVar) -> bool | None:
    """An on/off variable: ``None`` where it is unset or empty, else whether it is ``1``."""
    value = read(var)
    return None if not value else value == "1"


def check() -> None:
    """Read every variable now, so that a typo fails here, in one line, and not at first use."""
    for var in ALL:
        read(var)
