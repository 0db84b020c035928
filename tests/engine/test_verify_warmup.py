"""A serving engine's probe builds the verify at every block length before its verdict lands.

The kernels that need it (compiled per row count on a GPU) do not exist on this CPU, so what is
checked is the work itself: the forwards at the verdict's level, one per block length a burst can
verify (and a classic step where the level pins the chain), counted in the pin ledger under
``warm``, and run whether the verdict was measured or read from the store. A probe for the
``mlx-batchd probe`` command (``warm`` off) runs none.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.reference import load_measured
from workers.api import Level, ProbePolicy
from workers.engine.engine import Engine
from workers.exact.draws import within_draw
from workers.exact.probe import make_draws, probe_steps
from workers.exact.verdict_store import VerdictStore
from workers.exact.verify_warmup import PURPOSE, block_lengths
from workers.models.synthetic import PRESETS, write_model

VOCAB = 260
K = 3

pytestmark = pytest.mark.usefixtures("clean_kernel_state")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("warm") / "m", PRESETS["tiny-llama"], seed=5)


def _probe(
    engine: Engine, level: Level, store: VerdictStore, warm: list[int] | None = None
) -> tuple[object, list[str]]:
    """The engine's probe for one pairing pinned to ``level``, run to its verdict, building the
    verify at ``warm``'s block lengths; returns the verdict and the steps' labels."""
    model = engine.counted
    draws = make_draws(K, VOCAB, 4096, None)[:2]
    policy = ProbePolicy(pinned_level=level)
    steps = probe_steps(model, lambda: make_prompt_cache(model), {"t": 1}, draws, K, store, policy, warm=warm)
    engine.start_probe("pair", steps)
    labels: list[str] = []
    while engine.probing:
        engine.probe_step()
        if engine.probing:
            labels.append(engine.verdict_summary()["pair"]["at"])
    return engine.verdict("pair"), labels


def _warm(engine: Engine) -> list[dict[str, object]]:
    return [r for r in engine.ledger.snapshot()["pinned"] if r["purpose"] == PURPOSE]


@pytest.mark.parametrize("level", [Level.MIRRORED, Level.NARROW, Level.PADDED])
def test_every_block_length_runs_at_the_verdicts_level_before_it_lands(
    model_path: Path, tmp_path: Path, level: Level
) -> None:
    engine = Engine(load_measured(model_path), eos_token_ids=(0,), vocab_size=VOCAB)
    store = VerdictStore(tmp_path / "verdicts")
    chain = 1 if level.pins_chain else 0
    lengths = block_lengths(K)
    assert lengths == [2, 3, 4]
    verdict, labels = _probe(engine, level, store, lengths)
    assert verdict is not None and verdict.level == level.value and not verdict.from_cache
    assert _warm(engine) == [
        {"level": level.value, "purpose": PURPOSE, "forwards": K + chain, "rows": sum(lengths) + chain, "seconds": 0.0}
    ]
    assert labels[-len(lengths) - chain :][: len(lengths)] == [
        f"warm-up: verify of {n} rows at {level.value}" for n in lengths
    ]

    # A verdict from the store runs no draw, and still builds every length.
    again = Engine(load_measured(model_path), eos_token_ids=(0,), vocab_size=VOCAB)
    cached, labels = _probe(again, level, store, lengths)
    assert cached is not None and cached.from_cache and cached.level == level.value
    assert _warm(again)[0]["forwards"] == K + chain
    assert len([label for label in labels if not within_draw(label)]) == K + chain


def test_a_probe_without_warm_up_runs_none(model_path: Path, tmp_path: Path) -> None:
    engine = Engine(load_measured(model_path), eos_token_ids=(0,), vocab_size=VOCAB)
    verdict, _ = _probe(engine, Level.MIRRORED, VerdictStore(tmp_path / "v"))
    assert verdict is not None and verdict.level == Level.MIRRORED.value
    assert _warm(engine) == []


def test_a_drafter_that_always_proposes_k_builds_that_block_alone(model_path: Path, tmp_path: Path) -> None:
    """An MTP head or a draft model verifies K + 1 rows every round: the other lengths are not built."""
    from workers.engine.spec.drafters import DraftModel, MTPDrafter, PromptLookup

    assert (MTPDrafter.fixed_k, DraftModel.fixed_k, PromptLookup.fixed_k) == (True, True, False)
    assert block_lengths(K, fixed=True) == [K + 1]
    engine = Engine(load_measured(model_path), eos_token_ids=(0,), vocab_size=VOCAB)
    verdict, labels = _probe(engine, Level.MIRRORED, VerdictStore(tmp_path / "v"), block_lengths(K, fixed=True))
    assert verdict is not None and verdict.level == Level.MIRRORED.value
    assert _warm(engine) == [{"level": "mirrored", "purpose": PURPOSE, "forwards": 1, "rows": K + 1, "seconds": 0.0}]
    assert labels[-1] == f"warm-up: verify of {K + 1} rows at mirrored"


@pytest.mark.parametrize(("flag", "spec", "lengths"), [("mtp", "demo", [K + 1]), ("draft", "prompt-lookup", [2, 3, 4])])
def test_serving_start_up_builds_what_its_drafter_can_ask_for(flag: str, spec: str, lengths: list[int]) -> None:
    """Through the engine's start-up (``configure_bursts``) on the demo target: the MTP head's
    verdict lands after one block length is built, prompt lookup's after every one."""
    from workers.api import BurstSettings, EngineSettings
    from workers.engine.startup import configure_bursts
    from workers.models.loading import load

    loaded = load("demo")
    engine = Engine(loaded.model, eos_token_ids=(0,), vocab_size=loaded.info.vocab_size)
    configure_bursts(engine, loaded, EngineSettings(**{flag: spec}, bursts=BurstSettings(k=K)))
    labels: list[str] = []
    while engine.probing:
        engine.probe_step()
        labels += [v["at"] for v in engine.verdict_summary().values() if v.get("at")]
    warm = [r for r in labels if r.startswith("warm-up")]
    assert [int(w.split()[3]) for w in warm] == lengths
    assert [r["rows"] for r in _warm(engine)] == [sum(lengths)]
