"""Start-up work between steps (``workers.engine.background``): an engine whose kernel plans or
prefix-cache check are not stored yet serves at once, without them, and runs them a unit at a time
between its steps; the probe starts after them (its pairing names the plans).

The CPU's own policy does not calibrate, so these tests pick one that does (a few row counts)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.engine_thread import EngineThreadRun
from tests.helpers.fastpath import greedy_tokens
from tests.helpers.fastpath import policy as policy
from workers.api import EngineSettings, Finished, Job, Signal
from workers.engine import loop
from workers.engine.engine import Engine
from workers.engine.startup import configure_prefix_cache, start_probe
from workers.kernels import fastpath, plan_timing, plan_units
from workers.models import LoadedModel
from workers.models.loading import load

pytestmark = pytest.mark.usefixtures("policy")

PROMPTS = [[(5 * i + j) % 200 + 4 for j in range(5 + i)] for i in range(3)]


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder (no stored plans or checks) and a policy that calibrates 2..3 rows."""
    monkeypatch.setenv("MLX_BATCHD_CACHE", str(tmp_path))
    fastpath.set_active(fastpath.FastPath("calibrating", flatten=True, calibrate_rows=3))
    return tmp_path


@pytest.fixture()
def loaded(tiny_model: Path) -> Iterator[LoadedModel]:
    yield load(str(tiny_model))


@pytest.fixture(autouse=True)
def collected() -> Iterator[None]:
    """This test's models collected at its end: a planned module's end moves ``fastpath.generation``
    (``fastpath._forget``), which a later test timing compiled layers must not see mid-way."""
    yield
    gc.collect()


def _engine(loaded: LoadedModel, calibration: Any = "background") -> Engine:
    return Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size, calibration=calibration)


def test_an_engine_serves_before_its_plans_are_timed_and_the_same_tokens_after(
    cache: Path, loaded: LoadedModel
) -> None:
    """With an empty store the engine serves at once with no plans installed (also between units:
    what a unit installs to time a forward is removed after it), then stores and installs the plans
    it timed; greedy tokens before, during and after are the same."""
    engine = _engine(loaded)
    assert engine.starting and engine.kernel_plans == {} and fastpath.installed(loaded.model) == {}
    before = greedy_tokens(engine, PROMPTS, 6)
    units = 0
    during: dict[int, list[int]] = {}
    while engine.background.pending:
        engine.start_up_step()
        units += 1
        if engine.background.pending:
            assert fastpath.installed(loaded.model) == {}, f"plans installed after unit {units}"
            if units == 2:
                during = greedy_tokens(engine, PROMPTS, 6)
    assert units > 2 and during == before
    assert engine.kernel_plans and fastpath.installed(loaded.model) == engine.kernel_plans
    assert len(list((cache / "kernel-plans").glob("*[0-9a-f].json"))) == 1  # stored for the next start
    assert greedy_tokens(engine, PROMPTS, 6) == before
    row = engine.start_up_summary()["kernel plans"]
    assert row["status"] == "done" and row["units"] == units - 1  # the last call ended it, no unit


def test_an_engine_with_stored_plans_installs_them_at_once_and_queues_nothing(
    cache: Path, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed = _engine(loaded, "now")  # times and stores them
    assert timed.kernel_plans and not timed.starting

    def no_timing(m: Any, n: int, large: Any = None) -> Generator[str, None, dict[int, int]]:
        raise AssertionError("timed again although the plans were stored")
        yield ""  # a generator, as the one it replaces

    monkeypatch.setattr(plan_timing, "time_plan_steps", no_timing)
    plan_units.uninstall(loaded.model)
    engine = _engine(loaded)
    assert not engine.starting and engine.start_up_summary() == {}
    assert engine.kernel_plans == timed.kernel_plans == fastpath.installed(loaded.model)


def test_plans_another_process_stored_meanwhile_win_over_the_ones_timed_here(cache: Path, loaded: LoadedModel) -> None:
    """Two daemons starting together each time the plans between steps; the first to store them
    decides, so both run the same kernels."""
    store = cache / "kernel-plans"
    steps = plan_units.calibration_steps(loaded.model, store)
    next(steps)
    sh = plan_units.shapes_of(loaded.model)
    assert sh is not None
    theirs = {shape: {2: 16, 3: 16} for shape in sh.names}
    assert sh.load_or_time(store, lambda: theirs) == (theirs, False)  # the other process stores first
    while True:
        try:
            next(steps)
        except StopIteration as done:
            assert done.value == theirs
            break
    assert fastpath.installed(loaded.model) == fastpath.plans_summary(theirs)


def test_the_prefix_check_and_the_probe_wait_for_the_plans_and_name_them(cache: Path, loaded: LoadedModel) -> None:
    """Not stored: the prefix cache starts off and its check runs after the calibration (its stored
    result names the plans); the probe starts only then. A second engine reads both at once."""
    settings = EngineSettings(prefix_cache_bytes=64 << 20, probe_k=2)
    engine = _engine(loaded)
    configure_prefix_cache(engine, loaded, settings)
    start_probe(engine, loaded, settings, "none", 2)
    assert engine.prefix_cache is not None and not engine.prefix_cache.serving
    assert not engine.probing  # queued behind the plans and the check
    assert {k: v["status"] for k, v in engine.start_up_summary().items()} == {
        "kernel plans": "pending",
        "prefix check": "pending",
        "probe": "pending",
    }
    order: list[str] = []
    while engine.background.pending:
        engine.start_up_step()
        order += [k for k, v in engine.start_up_summary().items() if v["status"] == "done" and k not in order]
    assert order == ["kernel plans", "prefix check"] and engine.probing
    assert engine.prefix_cache.serving and engine.prefix_cache.verdict is not None
    assert not engine.prefix_cache.verdict.from_cache
    (record,) = (cache / "prefix-checks").glob("*.json")
    assert engine.kernel_plans and f'"{next(iter(engine.kernel_plans))}"' in record.read_text()

    again = _engine(loaded)
    configure_prefix_cache(again, loaded, settings)
    assert not again.starting and again.prefix_cache is not None and again.prefix_cache.serving
    assert again.prefix_cache.verdict is not None and again.prefix_cache.verdict.from_cache


class Recorded(EngineThreadRun):
    """Notes, at each request's end, how far the calibration was (read on the engine thread)."""

    def __init__(self, model: Path, **settings: Any) -> None:
        super().__init__(model, **settings)
        self.at_finish: dict[int, dict[str, Any]] = {}

    def _emit(self, signals: list[Signal]) -> None:
        for s in signals:
            if isinstance(s, Finished):
                self.at_finish[s.seq] = dict(self.engine.snapshot()["start_up"]["kernel plans"])  # type: ignore[typeddict-item]
        super()._emit(signals)


def test_a_request_is_served_between_units_before_the_calibration_ends(
    cache: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's loop: the first unit is held until a request is in the inbox; the request is
    served before the next unit, and the calibration ends after it."""
    submitted = threading.Event()
    real = plan_timing.time_plan_steps
    calls: list[int] = []

    def held(m: Any, n: int, large: tuple[int, ...] | None = None) -> Generator[str, None, dict[int, int]]:
        calls.append(n)
        if len(calls) == 1:
            assert submitted.wait(30)
        return (yield from real(m, n, large))

    monkeypatch.setattr(plan_timing, "time_plan_steps", held)
    recorded = Recorded(tiny_model, admit_idle_window_s=0.0)
    with recorded as t:
        t.engine.submit(Job(seq=1, prompt=[5, 6, 7], max_tokens=4))
        submitted.set()
        assert len(t.until_finished(1)) == 4
        deadline = time.monotonic() + 60
        while (end := t.engine.snapshot()["start_up"]["kernel plans"])["status"] != "done":  # type: ignore[typeddict-item]
            assert time.monotonic() < deadline, end
            time.sleep(0.02)  # polling: the loop offers no completion event
        plans = t.engine.snapshot()["kernel_plans"]  # type: ignore[typeddict-item]
    at_finish = recorded.at_finish[1]
    assert at_finish["status"] in ("pending", "running") and at_finish["units"] < end["units"]
    assert plans and len(calls) > 1


def test_a_busy_engine_still_finishes_its_calibration_within_its_share(
    cache: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine busy from before its first unit to after its last: the calibration ends while the
    request still runs (the pieces before the probe take a share of a busy engine's time)."""
    submitted = threading.Event()
    real = plan_timing.time_plan_steps

    def held(m: Any, n: int, large: tuple[int, ...] | None = None) -> Generator[str, None, dict[int, int]]:
        assert submitted.wait(30)
        return (yield from real(m, n, large))

    monkeypatch.setattr(plan_timing, "time_plan_steps", held)
    monkeypatch.setattr(loop, "START_UP_SHARE", 1.0)  # a unit every few steps: a short request suffices
    recorded = Recorded(tiny_model, admit_idle_window_s=0.0)
    with recorded as t:
        t.engine.submit(Job(seq=1, prompt=[5, 6, 7], max_tokens=600))
        submitted.set()
        assert len(t.until_finished(1)) == 600
    assert recorded.at_finish[1]["status"] == "done", recorded.at_finish[1]


def test_an_idle_engine_runs_no_start_up_unit_before_its_quiet_has_passed(
    cache: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle start-up units wait for ``START_UP_QUIET_S`` without work or commands: requests that follow
    each other (here with an hour's quiet asked for, and no share of busy time) meet no unit before,
    between or during them; the calibration is still pending after both."""
    monkeypatch.setattr(loop, "START_UP_QUIET_S", 3600.0)
    monkeypatch.setattr(loop, "START_UP_SHARE", 0.0)
    recorded = Recorded(tiny_model, admit_idle_window_s=0.0)
    with recorded as t:
        for seq in (1, 2):
            t.engine.submit(Job(seq=seq, prompt=[5, 6, 7], max_tokens=4))
            assert len(t.until_finished(seq)) == 4
    assert [(recorded.at_finish[s]["status"], recorded.at_finish[s]["units"]) for s in (1, 2)] == [("pending", 0)] * 2
