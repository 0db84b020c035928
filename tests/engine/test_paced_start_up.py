"""Start-up work prefills in chunks sized by the engine's prefill pace (``Holdings.paced``): on a slow
machine one unit of the prefix check or of the probe (a prefill forward) lasts about
``START_UP_UNIT_S``, so a request waiting behind it, a busy engine's share of start-up work and the
watchdog never see a unit of a whole 2,048-token chunk. The check's and the probe's verdicts are
those of the unpaced run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.units import Counted
from workers.api import EngineSettings
from workers.engine.engine import Engine
from workers.engine.holdings import START_UP_UNIT_S
from workers.engine.startup import configure_prefix_cache, start_probe
from workers.exact import paced, prefill_chunk
from workers.models import LoadedModel
from workers.models.loading import load

#: Seconds per forwarded row recorded into the pace (a serving step's target: 100 tokens), and the
#: chunk a start-up unit gets from it.
PER_ROW_S = 0.01
TARGET_S = 1.0
CHUNK = int(START_UP_UNIT_S / PER_ROW_S)


def _start_up(loaded: LoadedModel, slow: bool) -> tuple[Engine, list[tuple[str, int]]]:
    """An engine (its pace measured slow when ``slow``) running its prefix check and the probe to
    their ends, every forward of both counted."""
    events: list[tuple[str, int]] = []
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size)
    if slow:
        engine.pace.target_s = TARGET_S
        engine.pace.record(200, 200 * PER_ROW_S)
    engine.counted = Counted(engine.counted, events)  # type: ignore[assignment]
    settings = EngineSettings(prefix_cache_bytes=64 << 20, probe_k=2)
    configure_prefix_cache(engine, replace(loaded, model=Counted(loaded.model, events)), settings)
    start_probe(engine, loaded, settings, "prompt-lookup", 2)
    while engine.starting:
        engine.start_up_step()
    return engine, events


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return load(str(tiny_model))


def test_a_slow_engines_start_up_prefills_in_the_chunks_its_pace_allows_with_the_same_verdicts(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "slow"))
    slow, slow_events = _start_up(loaded, slow=True)
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path / "fast"))
    fast, fast_events = _start_up(loaded, slow=False)
    # The unpaced run prefills the check's 2,098-token draw in a 2,048-token chunk; the paced one
    # never forwards more than the pace's 50 tokens, and does forward that many.
    assert max(n for _, n in fast_events) == 2048
    assert max(n for _, n in slow_events) == CHUNK
    assert len(slow_events) > len(fast_events)
    for engine in (slow, fast):
        assert engine.prefix_cache is not None and engine.prefix_cache.serving
        assert engine.prefix_cache.verdict is not None and engine.prefix_cache.verdict.exact
    assert slow.prefix_cache.verdict.reason == fast.prefix_cache.verdict.reason  # type: ignore[union-attr]
    [(name, verdict)] = slow.verdicts.items()
    assert verdict.level is not None and verdict.level == fast.verdicts[name].level
    assert _rungs(verdict) == _rungs(fast.verdicts[name])


def _rungs(verdict: Any) -> list[tuple[str, bool]]:
    """Each rung the probe reached and whether it was exact."""
    return [(r.level, r.exact) for r in verdict.ladder]


def test_paced_work_reads_its_chunk_once_and_leaves_it_outside() -> None:
    """The chunk is read when the first unit runs (one size for the whole run) and is in force only
    inside the work's own units."""
    asked: list[int] = []
    sizes = iter([50, 7])

    def chunk() -> int:
        asked.append(1)
        return next(sizes)

    def work() -> Any:
        seen = []
        for _ in range(3):
            seen.append(prefill_chunk())
            yield "unit"
        return seen

    steps = paced(work(), chunk)
    labels = []
    while True:
        try:
            labels.append(next(steps))
        except StopIteration as end:
            seen = end.value
            break
        assert prefill_chunk() == 2048  # between the units: what serves there is not paced
    assert labels == ["unit"] * 3 and seen == [50, 50, 50] and asked == [1]
