"""Verdicts memoised by fingerprint: what can change a verdict, hashed, and the JSON files that hold them.

A pairing's fingerprint covers the weights and config (hashed by content), the drafter, the cache
types serving builds, the backend and versions, and the probe's own method (``PROBE_VERSION``);
a stored verdict is used only for exactly that fingerprint, and only when it reads back valid.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from workers.exact.results import Verdict
from workers.kernels import CUDNN_ATTENTION_ENV, backend_fingerprint, fastpath
from workers.models import model_files

log = logging.getLogger("mlx_batchd.probe")

#: Bump when the probe's method changes, so persisted verdicts are re-measured.
PROBE_VERSION = 7
#: A stored verdict larger than this is not read (one holds a few kilobytes).
MAX_VERDICT_BYTES = 8 << 20
#: A file-hash memo larger than this is not read (a model has a handful of files).
MAX_MEMO_BYTES = 1 << 20


def _file_sha256(path: Path, memo: dict[str, Any]) -> str:
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    if key not in memo:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        memo[key] = h.hexdigest()
    return str(memo[key])


def model_fingerprint(model_dir: Path, cache_dir: Path) -> str:
    """sha256 over the config and every weight file's content (file hashes memoised by size
    and mtime, so a 5 GB checkpoint is read once)."""
    memo_path = cache_dir / "file-hashes.json"
    memo: dict[str, Any] = {}
    try:
        if memo_path.is_file() and memo_path.stat().st_size <= MAX_MEMO_BYTES:
            loaded = json.loads(memo_path.read_text())
            memo = {k: v for k, v in loaded.items() if isinstance(v, str)} if isinstance(loaded, dict) else {}
    except (OSError, ValueError) as exc:  # unreadable or damaged: the files are hashed again
        log.warning("ignoring the file-hash memo %s (%s)", memo_path, exc)
    h = hashlib.sha256()
    for path in model_files(model_dir):
        h.update(path.name.encode())
        h.update(_file_sha256(path, memo).encode())
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        memo_path.write_text(json.dumps(memo))
    except OSError as exc:  # an unusable cache folder costs the memo only
        log.warning("cannot keep the file-hash memo in %s (%s); weights are hashed again next start", cache_dir, exc)
    return h.hexdigest()


def pairing_fingerprint(pairing: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps({**pairing, "probe_version": PROBE_VERSION}, sort_keys=True).encode()).hexdigest()


class VerdictStore:
    """Verdicts as JSON files named by fingerprint."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, fingerprint: str) -> Path:
        return self.root / f"{fingerprint}.json"

    def get(self, fingerprint: str) -> Verdict | None:
        """The stored verdict for ``fingerprint``, or ``None`` (probe again) when there is none or
        the file does not hold a valid verdict for exactly this pairing: a damaged or forged
        file is never trusted, and says so in the log."""
        path = self.path(fingerprint)
        try:
            if not path.is_file():
                return None
            if path.stat().st_size > MAX_VERDICT_BYTES:
                raise ValueError(f"it holds more than {MAX_VERDICT_BYTES} bytes")
            verdict = Verdict.from_json(json.loads(path.read_text()))
            if verdict.fingerprint != fingerprint or pairing_fingerprint(verdict.pairing) != fingerprint:
                raise ValueError("it is the verdict of another pairing")
        except Exception as exc:  # anything in the file, however odd, means "probe again"
            log.warning("ignoring the stored verdict %s (%s); the pairing is probed again", path, exc)
            return None
        verdict.from_cache = True
        return verdict

    def put(self, verdict: Verdict) -> None:
        """Keep ``verdict``; a cache folder that cannot be made or written (an operator's
        ``MLX_BATCHD_CACHE`` pointing at a file, a read-only home) costs the store only: the verdict
        serves this process and the pairing is probed again at the next start."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.path(verdict.fingerprint).with_suffix(".tmp")
            tmp.write_text(json.dumps(verdict.to_json(), indent=2))
            tmp.replace(self.path(verdict.fingerprint))
        except OSError as exc:
            log.warning("cannot keep the verdict in %s (%s); it is probed again next start", self.root, exc)


def serving_pairing(
    model_dir: Path,
    config: dict[str, Any],
    drafter: str,
    cache: list[Any],
    cache_root: Path,
    kernel_plans: dict[str, str] | None = None,
    compiled_lone: int = 0,
) -> dict[str, Any]:
    """Everything that can change a verdict: weights and config, dtype and quantization (both in
    the config and the weights), drafter, the cache types serving builds, backend and versions, how
    attention runs (MLX's cuDNN attention on or off, contiguous K/V copies), and the batched path's
    kernel plans installed for the model (``fastpath.installed``), and how many of its layers classic
    decode runs compiled (``compiled_layers.lone``)."""
    return {
        "attention": {
            "cudnn": os.environ.get(CUDNN_ATTENTION_ENV, ""),
            "contiguous_kv": fastpath.active().contiguous_kv,
        },
        "model": model_fingerprint(model_dir, cache_root),
        "model_type": config.get("model_type"),
        "quantization": config.get("quantization"),
        "drafter": drafter,
        "caches": [type(c).__name__ + (f"({c.max_size})" if hasattr(c, "max_size") else "") for c in cache],
        "backend": backend_fingerprint(),
        "kernel_plans": kernel_plans or {},
        "compiled_layers": compiled_lone,
    }
