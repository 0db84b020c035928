"""The installed mlx-lm is a release ``workers.kernels.mlxlm`` (the one door to mlx-lm's private internals)
was written for, and pyproject.toml pins the same range."""

from __future__ import annotations

import re
from pathlib import Path

from workers.kernels import mlxlm

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_installed_mlx_lm_is_one_the_adapter_was_written_for() -> None:
    installed = mlxlm.installed_version()
    assert mlxlm.supported(installed), (
        f"mlx-lm {installed} is outside {mlxlm.SUPPORTED}: run tests/engine/test_mlxlm_adapter.py, fix the accessors in workers/kernels/mlxlm.py, "
        "then move SUPPORTED and the pin in pyproject.toml together"
    )
    assert mlxlm.supported(mlxlm.WRITTEN_AGAINST)
    pin = re.search(r'"mlx-lm>=([0-9.]+),<([0-9.]+)"', PYPROJECT.read_text())
    assert pin is not None, "pyproject.toml no longer pins mlx-lm as >=low,<high"
    assert (mlxlm.version_tuple(pin[1]), mlxlm.version_tuple(pin[2])) == mlxlm.SUPPORTED
    assert mlxlm.version_tuple("0.33.0.dev1") == (0, 33, 0)
    assert not mlxlm.supported("0.33.0.dev1") and not mlxlm.supported("0.32.1")
