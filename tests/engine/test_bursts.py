"""Speculative B = 1 bursts on the engine, with real models on the CPU.

Exactness is checked token for token against the same engine without a drafter. Divergence the
CPU does not produce is injected through ``workers.kernels.seam.divergence_seam`` and the tests that do
so say it in their names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

import workers.kernels.seam
from tests.reference import probed_bursts
from workers import kernels
from workers.api import BurstSettings, Finished, Job, Level, ProbePolicy, SamplingParams, Tokens
from workers.engine.engine import Engine
from workers.engine.spec.drafters import Drafter, DraftModel, PromptLookup
from workers.kernels import measure_widths
from workers.models.synthetic import llama_config, write_model

VOCAB = 260
EOS = (0,)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("burst-models")
    small = llama_config(hidden=128, layers=2, ffn=256)
    return {
        "target": write_model(root / "target", small, seed=11),
        "other": write_model(root / "other", llama_config(hidden=64, layers=1, ffn=128), seed=12),
    }


@pytest.fixture(scope="module")
def target(paths: dict[str, Path]) -> Any:
    model, _ = load(str(paths["target"]))
    measure_widths(model)
    return model


@pytest.fixture(autouse=True)
def clean_kernel_state() -> Iterator[None]:
    yield
    workers.kernels.seam.divergence_seam = None
    kernels.set_process_level(Level.WIDE)


def drafters(paths: dict[str, Path], target: Any) -> dict[str, Callable[[], Drafter]]:
    other, _ = load(str(paths["other"]))
    return {
        "draft-model-self": lambda: DraftModel(target, name="self"),  # accepts every draft
        "draft-model-other": lambda: DraftModel(other, name="other"),  # accepts almost none
        "prompt-lookup": PromptLookup,
    }


EXACT_FOREVER = BurstSettings(k=3, audit_fraction=0.0, profile_steps=0, min_rounds=10**9, lookahead_choice=False)


def make_engine(
    target: Any, drafter: Drafter | None, settings: BurstSettings = EXACT_FOREVER, policy: ProbePolicy | None = None
) -> Engine:
    """An engine whose drafter is gated by a real probe of the pairing (run to its end here)."""
    engine = Engine(target, eos_token_ids=EOS, vocab_size=VOCAB, max_batch=8)
    if drafter is not None:
        probed_bursts(engine, target, drafter, settings, f"test+{drafter.name}", VOCAB, draws=4, policy=policy)
    return engine


def run(
    engine: Engine,
    jobs: list[Job],
    arrivals: dict[int, list[Job]] | None = None,
    on_step: Callable[[Engine, int], None] | None = None,
) -> dict[int, tuple[list[int], str]]:
    """Submit ``jobs``, then step; ``arrivals[i]`` are submitted before step ``i``."""
    out: dict[int, list[int]] = {}
    ends: dict[int, str] = {}
    for job in jobs:
        engine.submit(job)
    arrivals = dict(arrivals or {})
    step = 0
    while engine.has_work or arrivals:
        for job in arrivals.pop(step, []):
            engine.submit(job)
        for event in engine.step():
            if isinstance(event, Tokens):
                out.setdefault(event.seq, []).extend(event.tokens)
            elif isinstance(event, Finished):
                ends[event.seq] = event.reason
        if on_step:
            on_step(engine, step)
        step += 1
    return {seq: (out.get(seq, []), ends[seq]) for seq in ends}


PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [100], [7, 7, 7, 7, 8, 8, 8, 8], [250, 3, 9, 27, 81]]


def job(seq: int, prompt: list[int], n: int = 40, **kw: Any) -> Job:
    return Job(seq=seq, prompt=prompt, max_tokens=n, **kw)


def classic(target: Any, jobs: list[Job]) -> dict[int, tuple[list[int], str]]:
    """Each job alone on an engine without a drafter: the yardstick."""
    return {j.seq: run(make_engine(target, None), [j])[j.seq] for j in jobs}


@pytest.mark.parametrize("kind", ["draft-model-self", "draft-model-other", "prompt-lookup"])
def test_bursts_are_byte_identical_to_classic_for_every_drafter(paths: dict[str, Path], target: Any, kind: str) -> None:
    jobs = [job(i, p, n=30 + 5 * i) for i, p in enumerate(PROMPTS)]
    want = classic(target, jobs)
    for j in jobs:
        engine = make_engine(target, drafters(paths, target)[kind]())
        assert run(engine, [j]) == {j.seq: want[j.seq]}
        assert engine.bursts.rounds > 0 and engine.bursts.round_seconds > 0
    if kind == "draft-model-self":
        assert engine.bursts.accepted == engine.bursts.drafted > 0


@pytest.mark.parametrize("kind", ["draft-model-self", "draft-model-other", "prompt-lookup"])
def test_bursts_interrupted_by_arrivals_and_resumed_stay_exact(paths: dict[str, Path], target: Any, kind: str) -> None:
    first = job(0, [5, 6, 7], n=80)
    later = [job(1, [40, 41, 42], n=12), job(2, [100, 101], n=20)]
    want = classic(target, [first, *later])
    engine = make_engine(target, drafters(paths, target)[kind]())
    got = run(engine, [first], arrivals={6: [later[0]], 30: [later[1]]})
    assert got == want  # the burst sequence and the batch's other rows, byte for byte
    assert engine.bursts.interrupted >= 2 and engine.bursts.bursts >= 3  # stopped twice, resumed
    assert engine.bursts.declined.get("contention", 0) >= 2


def test_an_arrival_is_prefilled_after_at_most_one_round(paths: dict[str, Path], target: Any) -> None:
    engine = make_engine(target, drafters(paths, target)["draft-model-self"]())
    engine.submit(job(0, [5, 6, 7], n=200))
    while engine.bursts.rounds < 3:
        engine.step()
    engine.submit(job(1, [9, 9, 9], n=5))
    rounds = engine.bursts.rounds
    engine.step()
    newcomer = engine._seqs[1]
    assert newcomer.prefill_started is not None or newcomer.first_token is not None
    assert engine.bursts.rounds == rounds  # no further round before its prefill


def test_declined_verdict_runs_no_burst(paths: dict[str, Path], target: Any) -> None:
    """Injected at the seam: the output head diverges whenever it runs on several rows."""

    def head_diverges(kind: str, out: mx.array, rows: int) -> mx.array:
        if kind == "projection" and out.shape[-1] == VOCAB and (rows > 1 or kernels.current_level() is not Level.WIDE):
            return (out.view(mx.uint16) ^ 1).view(out.dtype)
        return out

    workers.kernels.seam.divergence_seam = head_diverges
    engine = make_engine(target, drafters(paths, target)["prompt-lookup"]())
    workers.kernels.seam.divergence_seam = None
    assert engine.verdicts[engine.pairing].level is None  # type: ignore[index]
    j = job(0, [7, 7, 7, 7, 8, 8, 8, 8], n=30)
    assert run(engine, [j]) == classic(target, [j])
    assert engine.bursts.rounds == 0 and engine.bursts.declined == {"verdict_declined": 1}
    assert engine.bursts.round_seconds == 0.0


def test_injected_divergence_is_caught_by_the_audit_and_revokes_the_verdict(
    paths: dict[str, Path], target: Any
) -> None:
    """The probe passes; then a divergence is injected at the seam (multi-row projections). The
    audit catches the first round, the verdict is revoked and the sequence decodes classic."""
    settings = BurstSettings(k=3, audit_fraction=1.0, profile_steps=0, min_rounds=10**9)
    engine = make_engine(target, drafters(paths, target)["draft-model-self"](), settings)
    assert engine.verdicts[engine.pairing].level == "wide"  # type: ignore[index]
    j, later = job(0, [5, 6, 7], n=40), job(1, [5, 6, 7], n=20)
    want = classic(target, [j])[0]
    workers.kernels.seam.divergence_seam = lambda kind, out, rows: (
        (out.view(mx.uint16) ^ 1).view(out.dtype)
        if kind == "projection" and rows > 1 and out.shape[0] == 1 and out.ndim == 3 and out.shape[1] > 1
        else out
    )
    got = run(engine, [j])
    workers.kernels.seam.divergence_seam = None
    assert got == {0: want}  # the diverged round was thrown away
    assert engine.bursts.audit_failures == 1 and engine.bursts.rounds == 1
    assert engine.pairing in engine.revoked
    run(engine, [later])
    assert engine.bursts.rounds == 1 and engine.bursts.declined.get("revoked", 0) >= 1


def test_failing_drafter_falls_back_to_classic(paths: dict[str, Path], target: Any) -> None:
    """Fault injected in the drafter: it raises on its third proposal."""

    class Flaky(PromptLookup):
        calls = 0

        def propose(self, k: int, sampler: Any) -> Any:
            Flaky.calls += 1
            if Flaky.calls == 3:
                raise RuntimeError("injected drafter fault")
            return super().propose(k, sampler)

    j = job(0, [7, 7, 7, 7, 8, 8, 8, 8], n=40)
    engine = make_engine(target, Flaky())
    assert run(engine, [j]) == classic(target, [j])
    assert engine.bursts.rounds == 2 and engine.bursts.declined.get("drafter_error") == 1


def test_a_drafter_failing_to_start_loses_no_token(paths: dict[str, Path], target: Any) -> None:
    """Fault injected in the drafter's start: the sequence rejoins the batch, and the token it had
    pending when it was taken out is still emitted (the output equals classic decode)."""

    class NoStart(PromptLookup):
        def start(self, history: list[int]) -> None:
            raise RuntimeError("injected drafter start fault")

    j = job(0, [7, 7, 7, 7, 8, 8, 8, 8], n=40)
    engine = make_engine(target, NoStart())
    assert run(engine, [j]) == classic(target, [j])
    assert engine.bursts.rounds == 0 and engine.bursts.declined.get("drafter_error") == 1


def test_adaptive_policy_stops_bursts_that_do_not_pay(paths: dict[str, Path], target: Any) -> None:
    settings = BurstSettings(
        k=4, audit_fraction=0.0, profile_steps=2, min_rounds=3, reprofile_first_s=3600, reprofile_after_s=3600
    )
    engine = make_engine(target, drafters(paths, target)["draft-model-other"](), settings)
    j = job(0, [5, 6, 7], n=60)
    assert run(engine, [j]) == classic(target, [j])
    assert engine.adaptive.paused_until > 0  # a 1-layer stranger as drafter never pays
    assert engine.bursts.declined.get("profiling", 0) >= 1 and engine.bursts.declined.get("adaptive", 0) >= 1


def test_the_gate_times_each_step_to_the_next_steps_start(paths: dict[str, Path], target: Any) -> None:
    """A classic step and a round are each priced with the loop's work after it (here a 30 ms pause
    between steps, standing for emitting and handing tokens to the front end), so that one token's
    share and four's are compared alike; the wait of an engine with no work is no step's."""
    settings = BurstSettings(k=3, audit_fraction=0.0, profile_steps=3, min_rounds=10**9, lookahead_choice=False)
    engine = make_engine(target, drafters(paths, target)["draft-model-self"](), settings)
    j = job(0, [5, 6, 7], n=40)
    assert run(engine, [j], on_step=lambda e, i: time.sleep(0.03)) == classic(target, [j])
    gate = engine.adaptive
    assert gate.rounds >= 3 and gate.classic_samples >= 3
    assert min(gate._classic) >= 0.03 and min(gate._round_s) >= 0.03

    idle = make_engine(target, None)
    run(idle, [job(1, [5, 6, 7], n=8)])
    time.sleep(0.3)  # the loop waits for work: no step's time
    run(idle, [job(2, [9, 9], n=8)])
    assert idle.adaptive.classic_samples >= 8 and max(idle.adaptive._classic) < 0.3


class Sharpened:
    """The target with doubled logits: a drafter whose ``q`` overlaps ``p`` without equalling it, so
    both the acceptance test and the residual distribution are exercised."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.model(inputs, cache=cache) * 2.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _chi_square(counts: dict[int, int], probs: dict[int, float], n: int) -> float:
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items())


def test_sampled_bursts_keep_the_target_distribution(paths: dict[str, Path], target: Any) -> None:
    """Temperature 1, top-k 4: the first token a verify decides (emitted second) follows the
    target's distribution given the first. Chi-square, 3 degrees of freedom, alpha = 0.001."""
    prompt = [5, 6, 7]
    n_runs = 400
    drafter = DraftModel(Sharpened(target), name="sharpened-self")
    engine = make_engine(target, drafter)
    second: dict[int, dict[int, int]] = {}
    for seed in range(n_runs):
        sampling = SamplingParams(temperature=1.0, top_k=4, seed=seed)
        ((tokens, _),) = run(engine, [job(seed, prompt, n=2, sampling=sampling)]).values()
        if len(tokens) == 2:
            second.setdefault(tokens[0], {}).setdefault(tokens[1], 0)
            second[tokens[0]][tokens[1]] += 1
    assert engine.bursts.rounds >= n_runs * 0.9
    assert 0 < engine.bursts.accepted < engine.bursts.drafted  # both accepts and residual draws
    first, counts = max(second.items(), key=lambda kv: sum(kv[1].values()))
    n = sum(counts.values())
    cache = make_prompt_cache(target)
    logits = target(mx.array([prompt + [first]]), cache=cache)[0, -1].astype(mx.float32)
    top = mx.argsort(-logits)[:4].tolist()
    p = mx.softmax(logits[mx.array(top)]).tolist()
    probs = dict(zip(top, p))
    assert set(counts) <= set(top)
    assert n >= 80
    assert _chi_square(counts, probs, n) < 16.27


@pytest.fixture(scope="module")
def demo() -> Any:
    from workers.models.loading import load as load_model

    return load_model("demo")


def test_mtp_head_bursts_on_the_demo_pair_are_byte_identical(demo: Any) -> None:
    """The shipped MTP head drafting for the shipped target, alone and interrupted by an arrival."""
    from workers.engine.spec.drafters import load_mtp_drafter

    prompts = ["def fibonacci(n):", "class Stack:", "for i in range(10):"]
    jobs = [job(i, demo.tokenizer.encode(p), n=40) for i, p in enumerate(prompts)]
    eos = demo.info.eos_token_ids

    def engine_for(drafter: Drafter | None) -> Engine:
        engine = Engine(demo.model, eos_token_ids=eos, vocab_size=demo.info.vocab_size)
        if drafter is not None:
            from workers.exact.probe import Verdict

            engine.configure_bursts(drafter, EXACT_FOREVER, "demo+mtp")
            engine.verdicts["demo+mtp"] = Verdict("", {}, "wide", True, "CPU: exact (see test_probe)", [], 0.0)
        return engine

    want = {j.seq: run(engine_for(None), [j])[j.seq] for j in jobs}
    for j in jobs:
        engine = engine_for(load_mtp_drafter("demo", demo.model))
        assert run(engine, [j]) == {j.seq: want[j.seq]}
        assert 0 < engine.bursts.accepted <= engine.bursts.drafted
    engine = engine_for(load_mtp_drafter("demo", demo.model))
    assert run(engine, [jobs[0]], arrivals={4: [jobs[1]], 12: [jobs[2]]}) == want
    assert engine.bursts.interrupted >= 1


def test_echo_synth_gives_prompt_lookup_a_repetitive_workload(tmp_path: Path) -> None:
    """The ``-echo`` presets exist so that prompt lookup can be measured where it drafts: their greedy
    output repeats the prompt's last token, so after the first round every draft is kept, and the
    tokens are still classic decode's."""
    echo = write_model(tmp_path / "echo", llama_config(hidden=256, layers=4, ffn=512, echo=True), seed=11)
    model, _ = load(str(echo))
    measure_widths(model)
    prompt = [40, 41, 42, 43, 44, 45]
    want = classic(model, [job(0, prompt, n=48)])[0]
    assert want[0] == [45] * 48
    engine = make_engine(model, PromptLookup())
    assert run(engine, [job(0, prompt, n=48)]) == {0: want}
    b = engine.bursts
    assert b.rounds >= 5 and b.accepted >= b.drafted - 3
    assert b.drafted >= 3 * (b.rounds - 2), "past the first rounds, a round drafts k = 3 tokens of the repetition"
