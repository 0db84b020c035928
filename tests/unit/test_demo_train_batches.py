"""Pieces of the demo training script that decide what the drafters learn: how its batches mix pool
rows and real windows, and where file-start windows begin (no model, no training run)."""

from __future__ import annotations

import numpy as np

from tools.demo import phases


def test_mixed_batches_take_the_pool_share() -> None:
    tokens = np.arange(10_000, dtype=np.uint16) % 50 + 100  # real windows: ids 100..149
    pool = np.full((20, 9), 7, dtype=np.uint16)  # pool rows: all 7
    batch = next(phases.mixed_batches(tokens, pool, 8, np.random.default_rng(0), pool_share=0.75))
    rows = np.array(batch)
    assert rows.shape == (8, 9)
    assert int((rows == 7).all(axis=1).sum()) == 6
    only_real = next(phases.mixed_batches(tokens, pool, 8, np.random.default_rng(0), pool_share=0.0))
    assert not (np.array(only_real) == 7).any()


def test_file_start_windows_begin_right_after_an_eos() -> None:
    eos = 0
    files = [np.arange(1, n + 1, dtype=np.uint16) for n in (40, 55, 70, 35, 90)]
    tokens = np.concatenate([np.append(f, eos) for f in files]).astype(np.uint16)
    starts = phases.file_starts(tokens, eos)
    assert starts.tolist() == np.cumsum([0] + [len(f) + 1 for f in files[:-1]]).tolist()
    rng = np.random.default_rng(0)
    aligned = np.array(next(phases.batches(tokens, 16, 20, rng, starts, 1.0)))
    assert (aligned[:, 0] == 1).all()  # every file's first token is 1
    mixed = np.array(next(phases.batches(tokens, 16, 20, np.random.default_rng(1), starts, 0.25)))
    assert (mixed[12:, 0] == 1).all()  # the last quarter: file starts
    pool = np.full((4, 21), 7, dtype=np.uint16)
    rows = np.array(next(phases.mixed_batches(tokens, pool, 8, rng, 0.5, starts, 1.0)))
    assert (rows[:4, 0] == 1).all() and (rows[4:] == 7).all()
