"""``mlx-batchd bench-bursts``: what speculation and exactness cost and earn, on the engine.

Three tables, measured in one run on one model:

1. **Verify cost per level**: one verify block of ``K + 1`` tokens at each kernel level, in
   classic decode steps (block time / one B = 1 step), for several K.
2. **B = 1, classic vs bursts** per drafter: tokens/s, acceptance per drafted token, tokens per
   round, round cost in classic steps, speedup. Bursts run at the probe's verdict level.
3. **Batched decode with bursts configured** (they only run at B = 1, so this is the machinery's
   overhead, goal >= 99 %) and under the process-wide pin (the tax scoping avoids), vs plain.

Everything runs in this process on the engine (no sockets), so the numbers isolate the engine;
``mlx-batchd bench`` measures the daemon's own overhead.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from workers.burst import BurstSettings
from workers.drafters import Drafter, load_drafter, load_mtp_drafter
from workers.engine import Engine, Finished, Job, Tokens
from workers.kernels import LADDER, Level, set_process_level
from workers.models import LoadedModel, load
from workers.probe import ProbePolicy, make_draws, probe_steps, sliding_window


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, min(vocab, 256)) for _ in range(n)]


def _engine(loaded: LoadedModel, drafter: Drafter | None, k: int, level: str | None = None) -> Engine:
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size, max_batch=64)
    if drafter is not None:
        name = f"bench+{drafter.name}"
        policy = ProbePolicy(pinned_level=Level(level)) if level else ProbePolicy()
        draws = make_draws(k, loaded.info.vocab_size, loaded.info.context_length, sliding_window(loaded.config))[:3]
        steps = probe_steps(
            engine.counted, lambda: make_prompt_cache(loaded.model), {"b": name}, draws, k, None, policy
        )
        engine.start_probe(name, steps)
        while engine.probing:
            engine.probe_step()
        settings = BurstSettings(k=k, audit_fraction=0.0, profile_steps=0, min_rounds=10**9)
        engine.configure_bursts(drafter, settings, name)
    return engine


def _drive(engine: Engine, jobs: list[Job]) -> tuple[int, float]:
    """Generated tokens and seconds from the first submit to the last token."""
    tic = time.perf_counter()
    for j in jobs:
        engine.submit(j)
    n = 0
    while engine.has_work:
        for e in engine.step():
            if isinstance(e, Tokens):
                n += len(e.tokens)
            elif isinstance(e, Finished):
                pass
    return n, time.perf_counter() - tic


def _classic_step_s(loaded: LoadedModel, context: int) -> float:
    cache = make_prompt_cache(loaded.model)
    loaded.model(mx.array([_prompt(context, loaded.info.vocab_size, 1)]), cache=cache)
    mx.eval([c.state for c in cache])
    times = []
    for i in range(12):
        tic = time.perf_counter()
        mx.eval(loaded.model(mx.array([[5 + i]]), cache=cache))
        times.append(time.perf_counter() - tic)
    return statistics.median(times[2:])


def verify_costs(loaded: LoadedModel, ks: list[int], context: int) -> list[dict[str, Any]]:
    from workers.kernels import scoped, wrap_caches

    step = _classic_step_s(loaded, context)
    rows = []
    for k in ks:
        row: dict[str, Any] = {"k": k, "block": k + 1}
        for level in LADDER:
            times = []
            for rep in range(5):
                cache = make_prompt_cache(loaded.model)
                loaded.model(mx.array([_prompt(context, loaded.info.vocab_size, 2)]), cache=cache)
                mx.eval([c.state for c in cache])
                block = mx.array([_prompt(k + 1, loaded.info.vocab_size, 3 + rep)])
                tic = time.perf_counter()
                with scoped(level):
                    c = wrap_caches(cache) if level is Level.PER_QUERY else cache
                    mx.eval(loaded.model(block, cache=c))
                times.append(time.perf_counter() - tic)
            row[level.value] = statistics.median(times[1:]) / step
        rows.append(row)
    return rows


def b1_rows(
    loaded: LoadedModel, drafters: dict[str, Drafter], k: int, tokens: int, prompt_len: int, repeats: int
) -> list[dict[str, Any]]:
    vocab = loaded.info.vocab_size
    prompts = [_prompt(prompt_len, vocab, 100 + r) for r in range(repeats)]
    rows = []
    classic = _engine(loaded, None, k)
    _drive(classic, [Job(seq=-1, prompt=prompts[0], max_tokens=8)])
    base = statistics.median(
        n / s for n, s in (_drive(classic, [Job(seq=i, prompt=p, max_tokens=tokens)]) for i, p in enumerate(prompts))
    )
    rows.append(
        {
            "drafter": "classic (no drafter)",
            "tok_s": base,
            "acceptance": None,
            "tokens_per_round": None,
            "round_cost_steps": None,
            "speedup": 1.0,
            "level": "-",
        }
    )
    for name, drafter in drafters.items():
        engine = _engine(loaded, drafter, k)
        verdict = engine.verdicts[engine.pairing]  # type: ignore[index]
        _drive(engine, [Job(seq=-1, prompt=prompts[0], max_tokens=8)])
        before = dict(vars(engine.bursts))
        rates = [
            n / s for n, s in (_drive(engine, [Job(seq=i, prompt=p, max_tokens=tokens)]) for i, p in enumerate(prompts))
        ]
        b = engine.bursts
        rounds = b.rounds - before["rounds"]
        drafted = b.drafted - before["drafted"]
        accepted = b.accepted - before["accepted"]
        a = engine.adaptive
        rows.append(
            {
                "drafter": name,
                "tok_s": statistics.median(rates),
                "acceptance": accepted / drafted if drafted else None,
                "tokens_per_round": (b.emitted - before["emitted"]) / rounds if rounds else None,
                # one classic B = 1 step takes 1 / base seconds
                "round_cost_steps": a.round_s * base if a.round_s else None,
                "speedup": statistics.median(rates) / base,
                "level": f"{verdict.level or 'declined'}{'' if verdict.exact else ' (inexact)'}",
            }
        )
    return rows


def batched_rows(
    loaded: LoadedModel,
    drafter: Drafter | None,
    k: int,
    batches: list[int],
    tokens: int,
    prompt_len: int,
    process_level: Level,
    repeats: int = 2,
) -> list[dict[str, Any]]:
    """Tokens/s per batch size: plain, with bursts configured (they only run at B = 1) and under a
    process-wide pin. Arms alternate inside each batch size; the best of ``repeats`` runs is kept."""
    vocab = loaded.info.vocab_size
    rows = []
    plain = _engine(loaded, None, k)
    with_bursts = _engine(loaded, drafter, k) if drafter is not None else None
    for b in batches:
        jobs = [Job(seq=i, prompt=_prompt(prompt_len, vocab, 1000 * b + i), max_tokens=tokens) for i in range(b)]
        _drive(plain, jobs[:2])
        row: dict[str, Any] = {"batch": b}
        arms: list[tuple[str, Engine, Level]] = [("plain", plain, Level.WIDE)]
        if with_bursts is not None:
            arms.append(("bursts configured", with_bursts, Level.WIDE))
        arms.append((f"process pin ({process_level.value})", plain, process_level))
        rates: dict[str, list[float]] = {label: [] for label, _, _ in arms}
        for _ in range(repeats):
            for label, engine, level in arms:
                set_process_level(level)
                try:
                    fresh = [Job(seq=j.seq, prompt=j.prompt, max_tokens=j.max_tokens) for j in jobs]
                    n, s = _drive(engine, fresh)
                    rates[label].append(n / s)
                finally:
                    set_process_level(Level.WIDE)
        row.update({label: max(r) for label, r in rates.items()})
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]], fmt: dict[str, str]) -> str:
    cols = list(rows[0].keys())
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append("-" if v is None else (format(v, fmt.get(c, ".2f")) if isinstance(v, float) else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, 4))
    ks = [r["block"] for r in report["verify_cost"]]
    for level in [lv.value for lv in LADDER]:
        left.plot(ks, [r[level] for r in report["verify_cost"]], "o-", label=level)
    left.plot(ks, ks, ":", color="grey", label="block = that many steps")
    left.set(xlabel="verify block (tokens)", ylabel="cost in classic B = 1 steps", title="verify cost per level")
    left.legend()
    names = [r["drafter"] for r in report["b1"]]
    mid.barh(names, [r["tok_s"] for r in report["b1"]])
    mid.set(xlabel="tokens / s at B = 1", title="bursts vs classic")
    rows = report["batched"]
    bs = [r["batch"] for r in rows]
    for key in [k for k in rows[0] if k != "batch" and "/" not in k]:
        right.plot(bs, [r[key] for r in rows], "o-", label=key)
    right.set(xscale="log", xlabel="batch size", ylabel="tokens / s", title="batched decode")
    right.set_xscale("log", base=2)
    right.legend()
    fig.suptitle(f"{report['model']} on {report['device']} {report['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    loaded = load(args.model)
    drafters: dict[str, Drafter] = {}
    for spec in args.draft:
        drafters[spec] = load_drafter(spec, loaded.model, loaded.info.vocab_size)
    if args.mtp:
        drafters[f"mtp:{args.mtp}"] = load_mtp_drafter(args.mtp, loaded.model)
    ks = [int(x) for x in args.ks.split(",")]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "model": args.model,
        "device": str(mx.default_device()),
        "device_name": mx.device_info().get("device_name", "") if hasattr(mx, "device_info") else "",
    }
    with tqdm(total=3, desc="bench-bursts", unit="table") as bar:
        report["verify_cost"] = verify_costs(loaded, ks, args.context)
        bar.update()
        report["b1"] = b1_rows(loaded, drafters, args.k, args.tokens, args.prompt_tokens, args.repeats)
        bar.update()
        first = next(iter(drafters.values()), None)
        report["batched"] = batched_rows(
            loaded,
            first,
            args.k,
            batches,
            args.batched_tokens,
            args.prompt_tokens,
            Level(args.process_level),
            args.batched_repeats,
        )
        bar.update()
    for row in report["batched"]:
        base = row["plain"]
        for key in [c for c in row if c not in ("batch", "plain")]:
            row[f"{key} / plain"] = row[key] / base
    md = (
        f"Model {args.model} on {report['device']} {report['device_name']}; K = {args.k}; context {args.context} for verify costs.\n\n"
        "Verify block cost in classic B = 1 steps, per level:\n\n"
        + _table(report["verify_cost"], {})
        + "\nB = 1, classic vs bursts:\n\n"
        + _table(report["b1"], {"tok_s": ".1f", "acceptance": ".2f"})
        + "\nBatched decode tokens/s (bursts only run at B = 1):\n\n"
        + _table(report["batched"], {})
    )
    (out / "bursts.json").write_text(json.dumps(report, indent=2))
    (out / "bursts.md").write_text(md)
    _plot(report, out / "bursts.png")
    print(md)
    print(f"results in {out.resolve()}")
    return 0
