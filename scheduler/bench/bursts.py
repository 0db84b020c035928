"""``mlx-batchd bench-bursts``: what speculation and exactness cost and earn, on the engine.

Three tables, measured in one run on one model:

1. **Verify cost per level**: one verify block of ``K + 1`` tokens at each kernel level, in
   classic decode steps (block time / one B = 1 step), for several K.
2. **B = 1, classic vs bursts** per drafter: tokens/s, acceptance per drafted token, tokens per
   round, round cost in classic steps, speedup. Bursts run at the probe's verdict level.
3. **Batched decode with bursts configured** (they only run at B = 1, so this is the machinery's
   overhead, goal >= 99 %) and under the process-wide pin (the tax scoping avoids), vs plain.

Everything runs in this process on the engine (no sockets), so the numbers isolate the engine;
``mlx-batchd bench`` measures the daemon's own overhead. As there, every figure is the median of the
repeats with its spread (min-max), a ratio comes with the range its two arms' samples allow, the
arms' order rotates each repeat, and a drafter whose bursts did not run (declined verdict, or no
round) is reported as declined, never as a speedup. Each table is written to ``--out`` as soon as it
is finished, so a run stopped by an outer timeout keeps the tables it finished.
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

from scheduler.bench.b1 import b1_status
from scheduler.bench.output import progress, save_png, write_whole
from scheduler.bench.spreads import ratio_spread, rotated, spread
from workers.api import BurstSettings, Finished, Job, Level, ProbePolicy, Tokens, default_k
from workers.engine.engine import Engine
from workers.engine.spec.drafters import Drafter, load_drafter, load_mtp_drafter
from workers.exact.probe import make_draws, probe_steps, sliding_window
from workers.kernels import set_process_level
from workers.kernels.backend import backend_fingerprint
from workers.models.loading import LoadedModel, load


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, min(vocab, 256)) for _ in range(n)]


def _engine(
    loaded: LoadedModel, drafter: Drafter | None, k: int, level: str | None = None, max_batch: int = 64
) -> Engine:
    engine = Engine(loaded.model, eos_token_ids=(), vocab_size=loaded.info.vocab_size, max_batch=max_batch)
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


def _classic_step_s(loaded: LoadedModel, context: int, level: Level = Level.WIDE) -> float:
    """Median seconds of one classic B = 1 step at ``context`` tokens, built at ``level``."""
    from workers.kernels import scoped

    cache = make_prompt_cache(loaded.model)
    loaded.model(mx.array([_prompt(context, loaded.info.vocab_size, 1)]), cache=cache)
    mx.eval([c.state for c in cache])
    times = []
    for i in range(12):
        tic = time.perf_counter()
        with scoped(level):
            mx.eval(loaded.model(mx.array([[5 + i]]), cache=cache))
        times.append(time.perf_counter() - tic)
    return statistics.median(times[2:])


def verify_costs(loaded: LoadedModel, ks: list[int], context: int) -> list[dict[str, Any]]:
    from workers.kernels import scoped, wrap_caches

    step = _classic_step_s(loaded, context)
    # A rung that pins the chain (padded) also costs every classic step of the lone sequence.
    chain_tax = {lv.value: _classic_step_s(loaded, context, lv) / step for lv in Level if lv.pins_chain}
    progress("bench-bursts classic step at " + ", ".join(f"{n} {r:.2f} steps" for n, r in chain_tax.items()))
    rows = []
    for k in ks:
        row: dict[str, Any] = {"k": k, "block": k + 1} | {f"classic step at {n}": r for n, r in chain_tax.items()}
        for level in Level:
            times = []
            for rep in range(5):
                cache = make_prompt_cache(loaded.model)
                loaded.model(mx.array([_prompt(context, loaded.info.vocab_size, 2)]), cache=cache)
                mx.eval([c.state for c in cache])
                block = mx.array([_prompt(k + 1, loaded.info.vocab_size, 3 + rep)])
                tic = time.perf_counter()
                with scoped(level):
                    c = wrap_caches(cache) if level.per_query else cache
                    mx.eval(loaded.model(block, cache=c))
                times.append(time.perf_counter() - tic)
            row[level.value] = statistics.median(times[1:]) / step
        progress(f"bench-bursts verify K = {k}: " + ", ".join(f"{lv.value} {row[lv.value]:.2f} steps" for lv in Level))
        rows.append(row)
    return rows


def b1_row(
    name: str,
    rates: list[float],
    base: list[float],
    verdict: dict[str, Any],
    counts: dict[str, int],
    round_s: float | None,
) -> dict[str, Any]:
    """One drafter's B = 1 row against classic's samples ``base``. ``speedup`` is the ratio of medians
    only where bursts ran (``b1_status``); a declined drafter shows its ratio as ``vs_classic`` with
    ``speedup`` None."""
    rate, classic = statistics.median(rates), statistics.median(base)
    status = b1_status(verdict, counts["rounds"])
    return {
        "drafter": name,
        "tok_s": rate,
        "tok_s_spread": spread(rates),
        "vs_classic": rate / classic,
        "vs_classic_spread": ratio_spread(rates, base),
        "speedup": rate / classic if status == "bursts" else None,
        "status": status,
        "acceptance": counts["accepted"] / counts["drafted"] if counts["drafted"] else None,
        "tokens_per_round": counts["emitted"] / counts["rounds"] if counts["rounds"] else None,
        # one classic B = 1 step takes 1 / classic seconds
        "round_cost_steps": round_s * classic if round_s and status == "bursts" else None,
        "level": f"{verdict.get('level') or 'declined'}{'' if verdict.get('exact', False) else ' (inexact)'}",
    }


def b1_rows(
    loaded: LoadedModel, drafters: dict[str, Drafter], ks: dict[str, int], tokens: int, prompt_len: int, repeats: int
) -> list[dict[str, Any]]:
    """Classic and one engine per drafter (drafting ``ks[name]`` a round), each repeat on the same
    prompt, in an order rotated each repeat."""
    vocab = loaded.info.vocab_size
    prompts = [_prompt(prompt_len, vocab, 100 + r) for r in range(repeats)]
    engines = {"classic (no drafter)": _engine(loaded, None, 1)}
    for name, drafter in drafters.items():
        progress(f"bench-bursts: probing {name} at K = {ks[name]}")
        engines[name] = _engine(loaded, drafter, ks[name])
    for engine in engines.values():
        _drive(engine, [Job(seq=-1, prompt=prompts[0], max_tokens=8)])
    before = {name: dict(vars(e.bursts)) for name, e in engines.items()}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for rep, prompt in enumerate(prompts):
        for name in rotated(list(engines), rep):
            n, s = _drive(engines[name], [Job(seq=rep, prompt=prompt, max_tokens=tokens)])
            rates[name].append(n / s)
            progress(
                f"bench-bursts B = 1, repeat {rep + 1}/{repeats}, {name}: {n} tokens in {s:.3f} s = {n / s:.1f} tok/s"
            )
    base = rates["classic (no drafter)"]
    rows: list[dict[str, Any]] = [
        {
            "drafter": "classic (no drafter)",
            "tok_s": statistics.median(base),
            "tok_s_spread": spread(base),
            "vs_classic": 1.0,
            "vs_classic_spread": ratio_spread(base, base),
            "speedup": None,
            "status": "classic",
            "acceptance": None,
            "tokens_per_round": None,
            "round_cost_steps": None,
            "level": "-",
        }
    ]
    for name in drafters:
        engine = engines[name]
        v = engine.verdict(engine.pairing)
        verdict = {"level": v.level, "exact": v.exact} if v is not None else {}
        b = engine.bursts
        counts = {key: getattr(b, key) - before[name][key] for key in ("rounds", "drafted", "accepted", "emitted")}
        rows.append(b1_row(name, rates[name], base, verdict, counts, engine.adaptive.round_s))
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
    process-wide pin; each arm's median and spread, and its ratio to plain with the ratio's spread.
    The arms' order rotates each repeat."""
    vocab = loaded.info.vocab_size
    rows = []
    plain = _engine(loaded, None, k, max_batch=max(64, *batches))
    with_bursts = _engine(loaded, drafter, k, max_batch=max(64, *batches)) if drafter is not None else None
    arms: list[tuple[str, Engine, Level]] = [("plain", plain, Level.WIDE)]
    if with_bursts is not None:
        arms.append(("bursts configured", with_bursts, Level.WIDE))
    arms.append((f"process pin ({process_level.value})", plain, process_level))
    by_label = {label: (engine, level) for label, engine, level in arms}
    for b in batches:
        jobs = [Job(seq=i, prompt=_prompt(prompt_len, vocab, 1000 * b + i), max_tokens=tokens) for i in range(b)]
        for engine in {id(e): e for _, e, _ in arms}.values():
            _drive(engine, [Job(seq=j.seq, prompt=j.prompt, max_tokens=j.max_tokens) for j in jobs[:2]])
        rates: dict[str, list[float]] = {label: [] for label, _, _ in arms}
        for rep in range(repeats):
            for label in rotated(list(by_label), rep):
                engine, level = by_label[label]
                set_process_level(level)
                try:
                    fresh = [Job(seq=j.seq, prompt=j.prompt, max_tokens=j.max_tokens) for j in jobs]
                    n, s = _drive(engine, fresh)
                    rates[label].append(n / s)
                finally:
                    set_process_level(Level.WIDE)
                progress(
                    f"bench-bursts B = {b}, repeat {rep + 1}/{repeats}, {label}: {n} tokens in {s:.3f} s = {n / s:.1f} tok/s"
                )
        row: dict[str, Any] = {"batch": b}
        for label, xs in rates.items():
            row[label] = statistics.median(xs)
            row[f"{label} spread"] = spread(xs)
        for label, xs in rates.items():
            if label != "plain":
                row[f"{label} / plain"] = row[label] / row["plain"]
                row[f"{label} / plain spread"] = ratio_spread(xs, rates["plain"])
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]], fmt: dict[str, str]) -> str:
    """Columns as the rows' keys; a ``[min, max]`` spread reads ``min-max``."""
    cols = list(rows[0].keys())
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def cell(c: str, v: Any) -> str:
        f = fmt.get(c.removesuffix(" spread").removesuffix("_spread"), ".2f")
        if v is None:
            return "-"
        if isinstance(v, list):
            return "-".join(format(x, f) for x in v)
        return format(v, f) if isinstance(v, float) else str(v)

    for r in rows:
        lines.append("| " + " | ".join(cell(c, r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], path: Path) -> None:
    """The tables finished so far, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, 4))
    if report.get("verify_cost"):
        ks = [r["block"] for r in report["verify_cost"]]
        for level in [lv.value for lv in Level]:
            left.plot(ks, [r[level] for r in report["verify_cost"]], "o-", label=level)
        left.plot(ks, ks, ":", color="grey", label="block = that many steps")
        left.legend()
    left.set(xlabel="verify block (tokens)", ylabel="cost in classic B = 1 steps", title="verify cost per level")
    if report.get("b1"):
        b1 = report["b1"]
        tok_s = [r["tok_s"] for r in b1]
        errors = [
            [t - r["tok_s_spread"][0] for t, r in zip(tok_s, b1)],
            [r["tok_s_spread"][1] - t for t, r in zip(tok_s, b1)],
        ]
        mid.barh([r["drafter"] for r in b1], tok_s, xerr=errors, capsize=4)
        mid.invert_yaxis()
    mid.set(xlabel="tokens / s at B = 1 (median, whiskers min-max)", title="bursts vs classic")
    if report.get("batched"):
        rows = report["batched"]
        bs = [r["batch"] for r in rows]
        for key in [k for k in rows[0] if k != "batch" and "/" not in k and not k.endswith(" spread")]:
            mids = [r[key] for r in rows]
            err = [
                [m - r[f"{key} spread"][0] for m, r in zip(mids, rows)],
                [r[f"{key} spread"][1] - m for m, r in zip(mids, rows)],
            ]
            right.errorbar(bs, mids, yerr=err, fmt="o-", capsize=3, label=key)
        right.set_xscale("log", base=2)
        right.legend()
    right.set(xlabel="batch size", ylabel="tokens / s", title="batched decode")
    fig.suptitle(f"{report['model']} on {report['device']} {report['device_name']}")
    save_png(fig, path)


def _markdown(report: dict[str, Any], args: argparse.Namespace) -> str:
    k = ", ".join(f"{name} {k}" for name, k in report.get("k", {}).items()) or "-"
    md = f"Model {args.model} on {report['device']} {report['device_name']}; K: {k}; context {args.context} for verify costs.\n"
    if report.get("verify_cost"):
        md += "\nVerify block cost in classic B = 1 steps, per level:\n\n" + _table(report["verify_cost"], {})
    if report.get("b1"):
        md += (
            f"\nB = 1, classic vs bursts (median of {args.repeats} repeats, min-max; speedup only where bursts ran):\n\n"
            + _table(report["b1"], {"tok_s": ".1f", "vs_classic": ".3f", "speedup": ".3f", "acceptance": ".2f"})
        )
    if report.get("batched"):
        md += (
            f"\nBatched decode tokens/s (bursts only run at B = 1; median of {args.batched_repeats} repeats, min-max):\n\n"
            + _table(report["batched"], {})
        )
    return md


def write(report: dict[str, Any], args: argparse.Namespace, out: Path) -> str:
    """JSON, Markdown and PNG of the tables finished so far; returns the Markdown."""
    md = _markdown(report, args)
    write_whole(out / "bursts.json", json.dumps(report, indent=2))
    write_whole(out / "bursts.md", md)
    _plot(report, out / "bursts.png")
    return md


def main(args: argparse.Namespace) -> int:
    progress(f"bench-bursts: loading {args.model}")
    loaded = load(args.model)
    drafters: dict[str, Drafter] = {}
    for spec in args.draft:
        drafters[spec] = load_drafter(spec, loaded.model, loaded.info.vocab_size)
    if args.mtp:
        drafters[f"mtp:{args.mtp}"] = load_mtp_drafter(args.mtp, loaded.model)
    # As serve: K as given, else the drafter's default (``workers.api.default_k``).
    report_k = {name: args.k or default_k(name.startswith("mtp:")) for name in drafters}
    ks = [int(x) for x in args.ks.split(",")]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "model": args.model,
        "device": str(mx.default_device()),
        "device_name": backend_fingerprint()["device_name"],
        "k": report_k,
    }
    progress(f"bench-bursts: verify cost per level, K = {args.ks}")
    report["verify_cost"] = verify_costs(loaded, ks, args.context)
    write(report, args, out)
    report["b1"] = b1_rows(loaded, drafters, report_k, args.tokens, args.prompt_tokens, args.repeats)
    write(report, args, out)
    first = next(iter(drafters), None)
    report["batched"] = batched_rows(
        loaded,
        None if first is None else drafters[first],
        report_k[first] if first is not None else 1,
        batches,
        args.batched_tokens,
        args.prompt_tokens,
        Level(args.process_level),
        args.batched_repeats,
    )
    print(write(report, args, out))
    print(f"results in {out.resolve()}", flush=True)
    return 0
