"""The embedded default models: what ``--model demo`` (and later ``--draft demo``, ``--mtp demo``)
resolve to.

The trained demo pair ships under ``weights/`` (issue 5). Until a kind is shipped there, the
target resolves to a small random-weight llama with a byte tokenizer, built once from a fixed
seed into a cache directory, so that a fresh machine can serve offline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

DemoKind = Literal["target", "draft", "mtp"]

SHIPPED = Path(__file__).parent / "weights"
#: Bump when the placeholder's config or builder changes, so stale caches are rebuilt.
PLACEHOLDER_VERSION = 1


def cache_dir() -> Path:
    """Where generated models live: ``$MLX_BATCHD_CACHE`` or ``~/.cache/mlx-batchd``."""
    root = os.environ.get("MLX_BATCHD_CACHE") or Path.home() / ".cache" / "mlx-batchd"
    return Path(root)


def _placeholder_target() -> Path:
    from workers.synthetic import llama_config, write_model

    path = cache_dir() / f"demo-placeholder-v{PLACEHOLDER_VERSION}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_model(tmp, llama_config(), seed=0)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its copy is identical
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


def demo_path(kind: DemoKind = "target") -> Path:
    """The directory for one demo artifact, offline."""
    shipped = SHIPPED / kind
    if (shipped / "config.json").exists():
        return shipped
    if kind == "target":
        return _placeholder_target()
    raise FileNotFoundError(f"no demo {kind} is shipped with this build of mlx-batchd")


def is_placeholder(path: Path) -> bool:
    return path.name.startswith("demo-placeholder")
