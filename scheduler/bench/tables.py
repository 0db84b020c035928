"""The matrix's tables so far: the batched table and, once B = 1 finished, the B = 1 burst table
(JSON, Markdown, PNG), rewritten after each batch size so a run an outer timeout stops keeps its rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scheduler.bench.b1 import b1_rows, write_b1
from scheduler.bench.batched import Setup, batched_rows, write_report


def write_tables(
    samples: dict[tuple[str, int], list[float]],
    setup: Setup,
    meta: dict[str, Any],
    out: Path,
    counts: dict[str, dict[str, float]] | None = None,
    verdicts: dict[str, dict[str, Any]] | None = None,
    runs: list[dict[str, Any]] | None = None,
    gates: dict[str, dict[str, Any]] | None = None,
) -> str:
    """Write every table with the batch sizes finished so far and return their Markdown.

    Called after each batch size, so a run that an outer timeout stops keeps the rows it finished
    (``meta['complete']`` says whether every batch size is in). The B = 1 table needs the burst
    ``counts`` of its arms, taken when B = 1 finished."""
    done = setup.finished(samples)
    meta = {**meta, "batches": list(setup.batches), "batches_done": done, "complete": done == list(setup.batches)}
    rows = batched_rows(samples, setup)
    if not rows:
        return ""
    md = write_report(rows, meta, out, runs)
    if 1 in done and setup.b1_arms and counts is not None:
        md += "\n" + write_b1_table(samples, setup, meta, out, counts, verdicts or {}, runs or [], gates)
    return md


def write_b1_table(
    samples: dict[tuple[str, int], list[float]],
    setup: Setup,
    meta: dict[str, Any],
    out: Path,
    counts: dict[str, dict[str, float]],
    verdicts: dict[str, dict[str, Any]],
    runs: list[dict[str, Any]],
    gates: dict[str, dict[str, Any]] | None = None,
) -> str:
    """The B = 1 burst table (JSON, Markdown, PNG) from the samples so far; returns its Markdown."""
    b1 = b1_rows(samples, counts, verdicts, setup.reference(1), gates)
    return write_b1(b1, meta, out, setup.reference_line(1), [r for r in runs if r["batch"] == 1])
