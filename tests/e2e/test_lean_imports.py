"""Neither of the daemon's processes imports PyTorch or scikit-learn where they are installed
(``scheduler.lean_imports``): transformers, which mlx-lm's tokenizer imports, would load them at every
start. A real daemon, with stand-in packages of those names first on its path that record an import."""

from __future__ import annotations

import os
from pathlib import Path

from scheduler.lean_imports import UNUSED
from tests.conftest import start_daemon
from tests.helpers.daemons import serve_once

#: A stand-in package: it marks its import (package and process) and then fails it.
STAND_IN = """import os
import pathlib

pathlib.Path(os.environ["LEAN_IMPORTS_MARKS"], f"{__name__}-{os.getpid()}").touch()
raise ImportError("a stand-in package: its import is what the test looks for")
"""


def test_a_daemon_serves_without_importing_torch_or_sklearn(tiny_model: Path, tmp_path: Path) -> None:
    site, marks = tmp_path / "site", tmp_path / "marks"
    marks.mkdir()
    for name in UNUSED:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(STAND_IN)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    daemon = start_daemon(
        tiny_model,
        tmp_path / "d",
        "--prefix-cache-mb",
        "0",
        env={"PYTHONPATH": path, "LEAN_IMPORTS_MARKS": str(marks)},
    )
    log = serve_once(daemon)
    assert sorted(p.name for p in marks.iterdir()) == [], log
