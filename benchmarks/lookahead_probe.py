"""What building the next burst round during this one saves (``workers.engine.spec.lookahead``), on the engine.

    python benchmarks/lookahead_probe.py --model demo --tokens 128 --out lookahead.json

B = 1 greedy decode of one prompt, three arms in rotated order per repeat: classic decode, bursts
with the next round built ahead off, and on. ``--drafter oracle`` (the default) is a stand-in (named
as such): it proposes the target's own greedy continuation (decoded classically first), so every
draft is kept and every guess of the next round is right; its figures are the mechanics' best case
(what a workload whose drafts are all accepted gets), not a drafter's. ``--drafter mtp:PATH`` drafts
with an MTP head (``mtp:demo``: the shipped pair's), whose next proposal is built on the verify's
outputs; with it a fourth arm has its drafts evaluated before the verify is built (``draft_in_verify``
off; the other burst arms compute them with the verify). Bursts run at the level a probe of the pairing gives,
as the daemon runs them. Prints and writes tokens/s per arm (median of ``--repeats``, with min-max),
burst rounds and rounds built ahead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from workers.api import BurstSettings, Job, ProbePolicy, Tokens
from workers.engine.engine import Engine
from workers.engine.spec.drafters import Draft, Drafter, load_mtp_drafter
from workers.engine.spec.policy import BurstCounters
from workers.exact.probe import make_draws, probe_steps, sliding_window
from workers.models.loading import LoadedModel, load


class Oracle:
    """Stand-in drafter: the target's greedy continuation ``path``, by position."""

    needs_hidden = False

    def __init__(self, path: list[int]) -> None:
        self.name = "oracle"
        self.path = path
        self._n = 0

    def start(self, history: list[int]) -> None:
        self._n = len(history)

    def propose(self, k: int, sampler: Any) -> Draft:
        return Draft(self.path[self._n : self._n + k])

    def propose_after(self, history: list[int], k: int) -> list[int]:
        return self.path[len(history) : len(history) + k]

    def commit(self, accepted: int, history: list[int], hidden: Any = None) -> None:
        self._n = len(history)

    def stop(self) -> None:
        self._n = 0


def _engine(loaded: LoadedModel, drafter: Drafter | None, k: int, lookahead: bool, fused: bool = True) -> Engine:
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size, max_batch=4)
    if drafter is not None:
        name = f"lookahead-probe+{drafter.name}"
        draws = make_draws(k, loaded.info.vocab_size, loaded.info.context_length, sliding_window(loaded.config))
        steps = probe_steps(
            engine.counted, lambda: make_prompt_cache(loaded.model), {"b": name}, draws, k, None, ProbePolicy()
        )
        engine.start_probe(name, steps)
        while engine.probing:
            engine.probe_step()
        settings = BurstSettings(
            k=k,
            audit_fraction=0.0,
            profile_steps=0,
            min_rounds=10**9,
            lookahead=lookahead,
            lookahead_choice=False,
            draft_in_verify=fused,
        )
        engine.configure_bursts(drafter, settings, name)
    return engine


def _run(engine: Engine, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    out: list[int] = []
    tic = time.perf_counter()
    engine.submit(Job(seq=0, prompt=prompt, max_tokens=tokens))
    while engine.has_work:
        for e in engine.step():
            if isinstance(e, Tokens):
                out += e.tokens
    return out, time.perf_counter() - tic


def _report_divergence(name: str, engine: Engine, got: list[int], want: list[int], out: str) -> None:
    """Fail closed, saying where the arm left classic decode and with which verdict (what a device run
    needs to tell a wrong level from a wrong burst)."""
    at = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want)))
    found = {
        "arm": name,
        "first_difference": at,
        "lengths": [len(got), len(want)],
        "verdicts": {n: v.to_json() for n, v in engine.verdicts.items()},
        "bursts": engine.burst_summary(),
    }
    with open(out, "w") as f:
        json.dump({"diverged": found}, f, indent=1, default=str)
    raise SystemExit(f"{name}: tokens differ from classic decode's at position {at}: {json.dumps(found, default=str)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drafter", default="oracle", help="oracle (a stand-in that knows the continuation) or mtp:PATH")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    loaded = load(a.model)
    prompt = [(7 * i) % 200 + 5 for i in range(32)]
    reference, _ = _run(_engine(loaded, None, a.k, False), prompt, a.tokens + 2 * a.k + 2)
    path = prompt + reference

    def drafter() -> Drafter:
        if a.drafter == "oracle":
            return Oracle(path)
        if a.drafter.startswith("mtp:"):
            return load_mtp_drafter(a.drafter.removeprefix("mtp:"), loaded.model)
        raise SystemExit(f"--drafter {a.drafter!r}: expected oracle or mtp:PATH")

    arms = {
        "classic": lambda: _engine(loaded, None, a.k, False),
        "bursts": lambda: _engine(loaded, drafter(), a.k, False),
        "bursts+lookahead": lambda: _engine(loaded, drafter(), a.k, True),
    }
    if a.drafter.startswith("mtp:"):  # drafts evaluated before the verify is built (``draft_in_verify`` off)
        arms["bursts-drafts-first"] = lambda: _engine(loaded, drafter(), a.k, False, fused=False)
    engines = {name: make() for name, make in arms.items()}
    for engine in engines.values():  # first use of each shape, untimed; counters from the timed runs on
        _run(engine, prompt, 8)
        engine.runner.counters = BurstCounters()
    samples: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for rep in range(a.repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            engine = engines[name]
            got, seconds = _run(engine, prompt, a.tokens)
            if got != reference[: a.tokens]:
                _report_divergence(name, engine, got, reference[: a.tokens], a.out)
            samples[name].append(len(got) / seconds)
            print(f"repeat {rep + 1}/{a.repeats} {name}: {len(got) / seconds:.1f} tok/s", flush=True)
    report: dict[str, Any] = {"model": a.model, "drafter": a.drafter, "tokens": a.tokens, "k": a.k, "arms": {}}
    step_s = 1 / statistics.median(samples["classic"])  # a classic step: one token
    for name, xs in samples.items():
        c = engines[name].runner.counters
        row: dict[str, Any] = {"tok_s": statistics.median(xs), "spread": [min(xs), max(xs)], "rounds": c.rounds}
        row["acceptance"] = c.accepted / c.drafted if c.drafted else None
        row["ahead_rounds"] = c.ahead
        row["fused_rounds"] = c.fused
        if c.rounds:  # a round's wall time in classic steps, from the medians (every token came from a round)
            row["round_in_steps"] = (c.emitted / c.rounds) / row["tok_s"] / step_s
        report["arms"][name] = row
    for name, row in report["arms"].items():
        per_round = f", a round {row['round_in_steps']:.2f} classic steps" if "round_in_steps" in row else ""
        print(
            f"{name}: {row['tok_s']:.1f} tok/s ({row['spread'][0]:.1f}-{row['spread'][1]:.1f}), "
            f"{row['tok_s'] * step_s:.3f}x classic, {row['rounds']} rounds, {row['ahead_rounds']} built ahead{per_round}",
            flush=True,
        )
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
