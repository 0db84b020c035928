"""Measured projection widths kept on disk (``$MLX_BATCHD_CACHE/widths/``), so a later start of the
same model on the same machine skips ``measure_widths``' forwards.

A file is keyed by what the widths depend on: the model's files (path, sizes, modification times), the
backend and its versions, the kernel switches and policy, the signatures measured and the measurement's settings.
One that does not read back as a width for exactly the signatures asked is measured again. While the
test seam is set (``workers.kernels.seam``) nothing is read or kept: its widths are the seam's.
The probe still checks every width on the rows each block feeds it (``calibration.calibrate``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from workers import envs
from workers.kernels import backend_fingerprint, fastpath, seam

log = logging.getLogger("mlx_batchd")

#: Bump when the measurement changes, so stored widths are measured again.
WIDTHS_VERSION = 1
#: A widths file holds a few dozen signatures; a larger one is not read.
MAX_FILE_BYTES = 1 << 16


def model_files(model_dir: Path) -> list[Path]:
    """The files that make ``model_dir`` the model it is: its weights and its JSON (config,
    tokenizer), by name."""
    return [p for p in sorted(model_dir.iterdir()) if p.suffix in (".safetensors", ".json") and p.is_file()]


def files_key(model_dir: Path) -> list[list[Any]]:
    """Each of ``model_files``: name, size, modification time (ns)."""
    return [[p.name, (st := p.stat()).st_size, st.st_mtime_ns] for p in model_files(model_dir)]


def widths_key(model_dir: Path, signatures: list[str], max_width: int, seed: int) -> str:
    """The widths file's name for this model, machine and measurement."""
    body = {
        "model": str(model_dir.resolve()),
        "files": files_key(model_dir),
        "backend": backend_fingerprint(),
        "switches": {v.name: envs.read(v) for v in (envs.FASTPATH, envs.ROWKERNEL, envs.W4A16, envs.COMPILED_LAYERS)},
        "fastpath": fastpath.active().name,
        "signatures": sorted(signatures),
        "max_width": max_width,
        "seed": seed,
        "version": WIDTHS_VERSION,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class WidthStore:
    """The widths of one model directory under ``root``, looked up by the signatures measured."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root = root
        self.model_dir = model_dir
        self._key = ""

    def get(self, signatures: list[str], max_width: int, seed: int) -> dict[str, int] | None:
        """The stored widths for exactly ``signatures``, or ``None`` (measure them)."""
        if seam.divergence_seam is not None:
            return None
        try:
            self._key = widths_key(self.model_dir, signatures, max_width, seed)
            path = self.root / f"{self._key}.json"
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                return None
            return valid(json.loads(path.read_text()), signatures, max_width)
        except (OSError, ValueError) as exc:  # unreadable, damaged or forged: measured again
            log.warning("stored widths not used (%s); measuring them", exc)
            return None

    def put(self, widths: dict[str, int]) -> None:
        """Keep ``widths`` under the key of the last ``get``; a folder that cannot be written costs
        the next start the measurement only."""
        if not self._key or seam.divergence_seam is not None:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(widths, f, sort_keys=True)
            os.replace(tmp, self.root / f"{self._key}.json")
        except OSError as exc:
            log.warning("cannot keep the measured widths in %s (%s)", self.root, exc)


def valid(widths: Any, signatures: list[str], max_width: int) -> dict[str, int]:
    """``widths`` as read from a file, checked: an integer 1..``max_width`` for exactly ``signatures``."""
    if not isinstance(widths, dict) or set(widths) != set(signatures):
        raise ValueError("the file holds widths for other signatures")
    for sig, w in widths.items():
        if type(w) is not int or not 1 <= w <= max_width:
            raise ValueError(f"width {w!r} for {sig} is not 1..{max_width}")
    return dict(widths)
