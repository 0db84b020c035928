"""The embedded default models: what ``--model demo``, ``--draft demo`` and ``--mtp demo`` resolve to.

They ship inside the package under ``weights/`` (trained by ``tools/demo/train.py``; model card
``docs/demo-models.md``), so a fresh machine serves offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from workers import envs

DemoKind = Literal["target", "draft", "mtp"]

SHIPPED = Path(__file__).parent / "weights"


def cache_dir() -> Path:
    """Where generated state lives (memoised verdicts, file hashes): ``$MLX_BATCHD_CACHE`` or
    ``~/.cache/mlx-batchd``."""
    return Path(envs.read(envs.CACHE))


def demo_path(kind: DemoKind = "target") -> Path:
    """The directory of one shipped demo artifact."""
    path = SHIPPED / kind
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the demo {kind} is missing from this install ({path}); reinstall mlx-batchd")
    return path
