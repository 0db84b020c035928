"""The demo models' training corpus: a CPython standard library's ``.py`` files, minus generated data
modules and a fixed held-out set (never trained on in any form), and their tokens.
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.demo.tokenizer import EOS_TOKEN

# Held-out modules: small, self-contained pure-Python files that make natural code prompts. Their own
# tests are dropped from training too (see _LEAKY_TESTS), so held-out code was never seen in any form.
HELDOUT_FILES = (
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "difflib.py",
    "fractions.py",
    "graphlib.py",
    "heapq.py",
    "sched.py",
    "shlex.py",
    "statistics.py",
    "textwrap.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "json/scanner.py",
    "json/tool.py",
)
_LEAKY_TESTS = tuple(f"test/test_{Path(p).stem}.py" for p in HELDOUT_FILES if "/" not in p) + ("test/test_json/",)
# Generated data rather than code: codec tables and the pydoc topic dump. site-packages is not stdlib.
_EXCLUDED_DIRS = ("site-packages/", "dist-packages/", "encodings/", "pydoc_data/")
MAX_FILE_BYTES = 256 * 1024  # larger .py files are generated tables, not code worth imitating


@dataclass(frozen=True)
class Corpus:
    """The selected source files, as paths relative to the stdlib root, sorted."""

    root: Path
    train: tuple[str, ...]
    heldout: tuple[str, ...]

    def digest(self) -> str:
        """SHA-256 over every selected file's name and bytes: identifies the exact corpus."""
        h = hashlib.sha256()
        for rel in self.train + ("--heldout--",) + self.heldout:
            h.update(rel.encode() + b"\0")
            if rel != "--heldout--":
                h.update((self.root / rel).read_bytes())
        return h.hexdigest()


def default_stdlib() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_source(path: Path) -> str | None:
    """The file as text, or None if it is not UTF-8 (a handful of test files carry other encodings)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def select_files(root: Path) -> Corpus:
    """Split the stdlib's ``.py`` files into training and held-out sets (deterministic: sorted paths)."""
    train: list[str] = []
    heldout: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel or any(rel.startswith(d) or f"/{d}" in rel for d in _EXCLUDED_DIRS):
            continue
        if path.stat().st_size > MAX_FILE_BYTES or read_source(path) is None:
            continue
        if rel in HELDOUT_FILES:
            heldout.append(rel)
        elif rel in _LEAKY_TESTS or any(rel.startswith(t) for t in _LEAKY_TESTS if t.endswith("/")):
            continue
        else:
            train.append(rel)
    missing = set(HELDOUT_FILES) - set(heldout)
    if missing:
        raise ValueError(f"held-out files missing under {root}: {sorted(missing)}")
    return Corpus(root=root, train=tuple(train), heldout=tuple(heldout))


def encode_files(tokenizer, root: Path, files: tuple[str, ...]) -> np.ndarray:
    """Token ids of all files, each followed by EOS, as one uint16 stream (vocab < 65536)."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    texts = [read_source(root / f) or "" for f in files]
    out: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, dtype=np.uint16)


_DEF_END = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+\w+.*:[ \t]*$", re.M)


def def_prompt_ends(tokenizer, root: Path, files: tuple[str, ...]) -> np.ndarray:
    """Positions in :func:`encode_files`' stream just after the ``:`` of each one-line def/class header.

    Why: evaluation prompts end there (held-out functions, the demo's ``def fibonacci(n):``), so pool
    prompts that end there show the drafters how the target starts a body, not only mid-file text.
    """
    texts = [read_source(root / f) or "" for f in files]
    ends: list[int] = []
    base = 0
    for text, enc in zip(texts, tokenizer.encode_batch(texts)):
        tok_end = {e: i for i, (_, e) in enumerate(enc.offsets)}
        for m in _DEF_END.finditer(text):
            colon = m.start() + m.group(0).rstrip().rfind(":") + 1
            if colon in tok_end:
                ends.append(base + tok_end[colon] + 1)
        base += len(enc.ids) + 1
    return np.asarray(ends, dtype=np.int64)
