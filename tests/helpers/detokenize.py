"""The shipped demo target, whose byte-level BPE tokenizer the detokenizer tests use."""

from __future__ import annotations

from pathlib import Path

DEMO_TARGET = Path(__file__).resolve().parents[2] / "workers" / "models" / "demo" / "weights" / "target"
