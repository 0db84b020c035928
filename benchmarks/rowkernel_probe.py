"""Device measurement behind ``workers/kernels/rowkernel.py`` (run where MLX runs on CUDA).

    python benchmarks/rowkernel_probe.py --model "$M" --out rowkernel.json

1. Per projection shape of the model: the kernel against the plain-MLX reference (max abs error
   over max |reference|), row-exactness (each row of an M-row call byte-equal to the 1-row call),
   and milliseconds at M = 1, 2, 5, 8 against MLX's own quantized matmul at M = 1 and 5.
   Then each kernel variant (outputs per warp R, words per load VEC) at M = 1 and 5, with its error
   and row-exactness at M = 5; and the mirrored kernel (``qmv_rows``) at each (outputs per warp,
   weight tiles loaded ahead) in ``MIRRORED``: each row of a 1-, 2-, 4-, 5- and 8-row call byte-equal
   to MLX's own one-row call, and its milliseconds, beside MLX's as mlx-lm calls it and at its
   cheapest way per row count (flattened, padded to 8 or 16: what batched decode's plans choose from).
   ``--quick``: the mirrored kernel only.
2. Whole model at B = 1 (context 300): a classic step and 5- and 9-token blocks (K = 4, 8) at wide,
   at wide with every quantized projection planned to the mirrored kernel (``fastpath.KERNEL``, one
   row included: what a batched plan may choose), and at mirrored, for R = 1, 2, 4 outputs per warp;
   without ``--quick`` also per-query-1, mirrored "unfused" (one kernel call per projection, one
   attention call per query) and rowwise, in milliseconds and in wide classic steps, with the part
   of each spent building the graph before any kernel runs. ``--chained`` adds each forward stepped as
   a decode loop steps it (the next built while this one runs): what a step, or a verify built ahead,
   pays when building overlaps the device.
3. ``--profile-build N``: the N functions with the most own time while building (not evaluating) five
   wide one-token steps and five mirrored 5-token blocks on this host, real kernels and all: where a
   verify block's graph building goes, MLX's kernel-call entry points included.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from fastpath_probe import timeit  # this folder is the script's first path entry
from mlx_lm.models.cache import make_prompt_cache

from workers.api import Level
from workers.kernels import (
    attention,
    fastpath,
    install,
    plan_timing,
    qmv_launch,
    qmv_rows,
    rowkernel,
    scoped,
    stock,
    wrap_caches,
)
from workers.models.loading import load

#: (outputs per warp, words per load) pairs that part 1 times; the first is the module's default.
VARIANTS = ((rowkernel.OUTS_PER_WARP, rowkernel.VECTOR_WORDS), (2, 1), (8, 4))


#: (outputs per warp, weight tiles loaded ahead) of the mirrored kernel that part 1 times (the first
#: is the module's default).
MIRRORED = tuple(dict.fromkeys(((qmv_launch.OUTS_PER_WARP, qmv_launch.UNROLL), (4, 1), (4, 2), (4, 4), (8, 2))))
#: Rows per call that part 1 times the mirrored kernel (and MLX) at.
MIRRORED_ROWS = (1, 2, 4, 5, 8)
#: Outputs per warp of the mirrored kernel in part 2's whole-model runs (tiles ahead: the default).
#: MLX's own one-row kernel runs one warp per output (R = 1's structure); at R = 4 an N = 4096
#: projection gets 128 blocks of 8 warps, a quarter of MLX's.
WHOLE_OUTS = (1, 2, 4)
#: Forwards per chained timing (``--chained``).
CHAIN = 6


def use(variant: tuple[int, int]) -> None:
    """A rowkernel variant (outputs per warp, words per load), or (-r, u): the mirrored kernel with r
    outputs per warp and u tiles loaded ahead (0: the default; and the rowkernel's default), or (0, u):
    the mirrored kernel's launch settings by row count (``workers/kernels/qmv_launch.py``'s constants)."""
    if variant[0] == 0:
        use(VARIANTS[0])
        return
    if variant[0] < 0:
        qmv_launch.OUTS_PER_WARP, qmv_launch.UNROLL = -variant[0], variant[1] or MIRRORED[0][1]
        qmv_launch.PER_WARP = {}  # r outputs per warp at every row count
        variant = VARIANTS[0]
    else:
        qmv_launch.OUTS_PER_WARP, qmv_launch.UNROLL = MIRRORED[0]
        qmv_launch.PER_WARP = dict(qmv_launch.FEWER_OUTS)
    rowkernel.OUTS_PER_WARP, rowkernel.VECTOR_WORDS = variant


def shapes(model: nn.Module, quick: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seen: set[tuple[int, ...]] = set()
    for name, m in model.named_modules():
        if not isinstance(m, (nn.QuantizedLinear, nn.Linear)) or tuple(m.weight.shape) in seen:
            continue
        seen.add(tuple(m.weight.shape))
        d_in = m.weight.shape[-1] * 32 // m.bits if isinstance(m, nn.QuantizedLinear) else m.weight.shape[-1]
        x = mx.random.normal((8, d_in)).astype(mx.bfloat16)
        row: dict[str, Any] = {"shape": tuple(m.weight.shape)}
        if quick:
            row.update(mirrored_row(m, x))
            print(name, json.dumps(row), flush=True)
            out[name] = row
            continue
        kind, weights, extra = _kind(m)
        ref = rowkernel._reference(kind, x, weights, extra)
        got = rowkernel.project(m, x)
        if got is None:
            row["covered"] = False
            out[name] = row
            continue
        err = mx.max(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))) / mx.max(mx.abs(ref.astype(mx.float32)))
        row["rel_err"] = float(err.item())
        ones = [rowkernel.project(m, x[i : i + 1]) for i in range(8)]
        row["row_exact"] = {
            mm: all(
                bool(mx.array_equal(rowkernel.project(m, x[:mm])[i].view(mx.uint16), ones[i][0].view(mx.uint16)).item())  # type: ignore[index]
                for i in range(mm)
            )
            for mm in (2, 3, 5, 8)
        }
        row["kernel_ms"] = {
            mm: round(timeit(lambda mm=mm, m=m, x=x: rowkernel.project(m, x[:mm]), 20), 4) for mm in (1, 2, 5, 8)
        }
        with stock():
            row["mlx_ms"] = {mm: round(timeit(lambda mm=mm, m=m, x=x: m(x[:mm]), 20), 4) for mm in (1, 5)}
        row.update(mirrored_row(m, x))
        row["variants"] = {}
        for variant in VARIANTS[1:]:
            use(variant)
            five = rowkernel.project(m, x[:5])
            assert five is not None
            e = mx.max(mx.abs(five.astype(mx.float32) - ref[:5].astype(mx.float32))) / mx.max(
                mx.abs(ref.astype(mx.float32))
            )
            row["variants"][f"R{variant[0]}V{variant[1]}"] = {
                "rel_err": round(float(e.item()), 5),
                "row_exact_5": all(
                    bool(
                        mx.array_equal(
                            five[i].view(mx.uint16), rowkernel.project(m, x[i : i + 1])[0].view(mx.uint16)
                        ).item()
                    )  # type: ignore[index]
                    for i in range(5)
                ),
                "ms": {mm: round(timeit(lambda mm=mm, m=m, x=x: rowkernel.project(m, x[:mm]), 20), 4) for mm in (1, 5)},
            }
        use(VARIANTS[0])
        print(name, json.dumps(row), flush=True)
        out[name] = row
    return out


def mirrored_row(m: Any, x: mx.array) -> dict[str, Any]:
    """The mirrored kernel on this module at each (outputs per warp, tiles ahead) in ``MIRRORED``:
    each row of a call of ``MIRRORED_ROWS`` rows byte-equal to MLX's own one-row call, and
    milliseconds per call; MLX alongside, as mlx-lm calls it and at its cheapest way for each row
    count (flattened, or padded to 8 or 16 rows: what batched decode's plan can choose from)."""
    found = qmv_rows.covered(m, x)
    if found is None:
        return {}
    call = type(m).__call__
    original = getattr(call, "__wrapped__", call)
    row: dict[str, Any] = {}
    with stock():
        ones_mlx = [original(m, x[i : i + 1]) for i in range(8)]
        row["mlx_ms"] = {mm: round(timeit(lambda mm=mm, x=x: m(x[:mm][:, None]), 20), 4) for mm in MIRRORED_ROWS}
        row["mlx_best_ms"] = {}
        for mm in MIRRORED_ROWS:
            ways = {"called": row["mlx_ms"][mm]}
            for to in dict.fromkeys((mm, 8, 16)):
                if to >= mm:
                    xs = x[:mm] if to == mm else mx.concatenate([x[:mm], mx.zeros((to - mm, x.shape[1]), x.dtype)])
                    ways[f"rows{to}"] = round(timeit(lambda xs=xs: m(xs), 20), 4)
            best = min(ways, key=lambda k: ways[k])
            row["mlx_best_ms"][mm] = [best, ways[best]]
        for r, u in MIRRORED:
            qmv_launch.OUTS_PER_WARP, qmv_launch.UNROLL, qmv_launch.PER_WARP = r, u, {}
            mirrored = {mm: qmv_rows._launch(x[:mm], [found[:3]], found[3], found[4])[0] for mm in MIRRORED_ROWS}
            mx.eval(ones_mlx, mirrored)
            row[f"mirrored_R{r}U{u}"] = {
                "equals_mlx_one_row": all(
                    bool(mx.array_equal(out[i].view(mx.uint16), ones_mlx[i][0].view(mx.uint16)).item())
                    for mm, out in mirrored.items()
                    for i in range(mm)
                ),
                "ms": {
                    mm: round(
                        timeit(lambda mm=mm, x=x, f=found: qmv_rows._launch(x[:mm], [f[:3]], f[3], f[4])[0], 20), 4
                    )
                    for mm in MIRRORED_ROWS
                },
            }
    qmv_launch.OUTS_PER_WARP, qmv_launch.UNROLL = MIRRORED[0]
    qmv_launch.PER_WARP = dict(qmv_launch.FEWER_OUTS)
    return row


def _kind(m: Any) -> tuple[str, tuple[mx.array, ...], dict[str, int]]:
    found = rowkernel._weights(m)
    assert found is not None
    kind, weights, _, extra = found
    return kind, weights, extra


@contextmanager
def unfused(on: bool) -> Iterator[None]:
    """The mirrored rung as it was before sibling projections shared a call and queries an attention
    call: one kernel call per projection, one attention call per query (``on``), for comparison."""
    if not on:
        yield
        return
    siblings, width = dict(qmv_rows._siblings), attention.group_width
    qmv_rows._siblings.clear()
    attention.group_width = lambda *_: (1, False)  # type: ignore[assignment]
    try:
        yield
    finally:
        qmv_rows._siblings.update(siblings)
        attention.group_width = width  # type: ignore[assignment]


@contextmanager
def kernel_plans(model: nn.Module, on: bool) -> Iterator[None]:
    """Every quantized projection planned to the mirrored kernel at 1..8 rows (``fastpath.KERNEL``),
    classic decode's one row included: what batched decode's calibration may choose (``on``)."""
    if not on:
        yield
        return
    quantized = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    saved_plans, saved_one = dict(fastpath._plans), set(fastpath.one_row)
    for m in quantized:
        fastpath._plans[id(m)] = dict.fromkeys(range(1, qmv_rows.MAX_ROWS + 1), fastpath.KERNEL)
        fastpath.one_row.add(id(m))
    try:
        yield
    finally:
        fastpath._plans.clear()
        fastpath._plans.update(saved_plans)
        fastpath.one_row.clear()
        fastpath.one_row.update(saved_one)


def _prefilled(model: nn.Module, prompt: mx.array) -> list[Any]:
    """A fresh prompt cache with ``prompt`` prefilled and evaluated."""
    cache = make_prompt_cache(model)
    model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def whole_model(
    model: nn.Module,
    vocab: int,
    context: int = 300,
    quick: bool = False,
    blocks: tuple[int, ...] = (1, 5, 9),
    outs: tuple[int, ...] = WHOLE_OUTS,
    chained: bool = False,
    only: tuple[str, ...] = (),
) -> dict[str, Any]:
    prompt = mx.array([[(7 * i) % (vocab - 10) + 5 for i in range(context)]])

    def fresh() -> list[Any]:
        return _prefilled(model, prompt)

    def step_ms(level: Level, tokens: int) -> tuple[float, float]:
        """Median milliseconds of the whole forward, and of building its graph alone (Python and
        MLX's graph construction, before any kernel runs): what the GPU cannot hide at B = 1."""
        times, builds = [], []
        for rep in range(7):
            cache = fresh()
            block = mx.array([[11 + rep + j for j in range(tokens)]])
            tic = time.perf_counter()
            with scoped(level):
                c = wrap_caches(cache) if level.per_query and tokens > 1 else cache
                out = model(block, cache=c)
                built = time.perf_counter()
                mx.eval(out)
            times.append((time.perf_counter() - tic) * 1e3)
            builds.append((built - tic) * 1e3)
        mid = len(times[2:]) // 2
        return sorted(times[2:])[mid], sorted(builds[2:])[mid]

    def chain_ms(level: Level, tokens: int) -> float:
        """Median milliseconds per forward of ``CHAIN`` forwards stepped as a decode loop or a burst
        with its next verify built ahead steps them: each forward's first token is the previous
        forward's greedy token, and the next forward is built and queued before the host reads this
        one's, so graph building overlaps the device's work."""
        times = []
        for rep in range(5):
            cache = fresh()
            rest = mx.array([[12 + rep + j for j in range(tokens - 1)]], dtype=mx.int32)
            with scoped(level):
                c = wrap_caches(cache) if level.per_query and tokens > 1 else cache

                def forward(token: mx.array, c: Any = c, rest: mx.array = rest) -> mx.array:
                    block = mx.concatenate([token, rest], axis=1) if tokens > 1 else token
                    return plan_timing.greedy(model(block, cache=c))

                times.append(plan_timing.chained_ms(forward, mx.array([[11 + rep]], dtype=mx.int32), CHAIN))
        return sorted(times[1:])[len(times[1:]) // 2]

    out: dict[str, Any] = {}
    r0, u0 = MIRRORED[0]
    runs: list[tuple[str, Level, tuple[int, int]]] = [
        ("wide", Level.WIDE, VARIANTS[0]),
        *((f"wide-kernel-R{r or 'cfg'}U{u0}", Level.WIDE, (-r, u0)) for r in outs),
        *((f"mirrored-R{r or 'cfg'}U{u0}", Level.MIRRORED, (-r, u0)) for r in outs),
    ]
    if not quick:
        runs.append((f"mirrored-R{r0}-unfused", Level.MIRRORED, (-r0, 0)))
        runs.append((f"rowwise-R{VARIANTS[0][0]}V{VARIANTS[0][1]}", Level.ROWWISE, VARIANTS[0]))
        runs.insert(1, ("per-query-1", Level.PER_QUERY_1, VARIANTS[0]))
        runs += [(f"rowwise-R{v[0]}V{v[1]}", Level.ROWWISE, v) for v in VARIANTS[1:]]
    for name, level, variant in runs:
        if only and name != "wide" and not name.startswith(only):
            continue
        use(variant)
        out[name] = {}
        with unfused(name.endswith("-unfused")), kernel_plans(model, name.startswith("wide-kernel")):
            for t in blocks:
                key = f"block{t}" if t > 1 else "step"
                out[name][f"{key}_ms"], out[name][f"{key}_build_ms"] = step_ms(level, t)
                if chained and not name.startswith("wide-kernel"):
                    out[name][f"chain_{key}_ms"] = chain_ms(level, t)
        print(name, out[name], flush=True)
    use(VARIANTS[0])
    base = out["wide"]["step_ms"]
    for v in out.values():
        v["step_in_wide_steps"] = round(v["step_ms"] / base, 3)
        for t in (t for t in blocks if t > 1):
            v[f"block{t}_in_wide_steps"] = round(v[f"block{t}_ms"] / base, 3)
            v[f"block{t}_in_own_steps"] = round(v[f"block{t}_ms"] / v["step_ms"], 3)
            if f"chain_block{t}_ms" in v:
                v[f"chain_block{t}_in_chained_wide_steps"] = round(
                    v[f"chain_block{t}_ms"] / out["wide"]["chain_step_ms"], 3
                )
    out["attention_group_widths"] = {repr(k[:4]): v for k, v in attention._widths.items()}
    return out


def build_profile(model: nn.Module, vocab: int, top: int, context: int = 300) -> dict[str, Any]:
    """cProfile's top ``top`` functions by own time while building five forwards (graphs only, each
    evaluated outside the profile) per run: wide one-token steps, mirrored 5-token blocks."""
    prompt = mx.array([[(7 * i) % (vocab - 10) + 5 for i in range(context)]])
    report: dict[str, Any] = {}
    for name, level, tokens in (("wide-step", Level.WIDE, 1), ("mirrored-block5", Level.MIRRORED, 5)):
        caches = [_prefilled(model, prompt) for _ in range(6)]
        profile = cProfile.Profile()
        builds = []
        for i, cache in enumerate(caches):
            block = mx.array([[11 + i + j for j in range(tokens)]])
            with scoped(level):
                c = wrap_caches(cache) if level.per_query and tokens > 1 else cache
                if i:
                    profile.enable()
                tic = time.perf_counter()
                out = model(block, cache=c)
                builds.append((time.perf_counter() - tic) * 1e3)
                profile.disable()
                mx.eval(out)
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(top)
        report[name] = {"calls": stats.total_calls, "build_ms_profiled": builds[1:], "top": text.getvalue()}
        print(name, "python calls", stats.total_calls, "\n", text.getvalue(), flush=True)
    return report


def best_per_warp(whole: dict[str, Any], blocks: tuple[int, ...], outs: tuple[int, ...] = WHOLE_OUTS) -> str:
    """``rows:outputs`` pairs: for each block length of at most ``qmv_rows.MAX_ROWS`` tokens, the
    outputs per warp whose whole forwards (every projection through the kernel, and the mirrored
    level) took the least time together."""
    pairs = []
    for t in (t for t in blocks if t <= qmv_rows.MAX_ROWS):
        key = "step_ms" if t == 1 else f"block{t}_ms"
        ms = {
            r: whole[f"wide-kernel-R{r}U{MIRRORED[0][1]}"][key] + whole[f"mirrored-R{r}U{MIRRORED[0][1]}"][key]
            for r in outs
            if r and f"mirrored-R{r}U{MIRRORED[0][1]}" in whole and f"wide-kernel-R{r}U{MIRRORED[0][1]}" in whole
        }
        if not ms:
            continue
        pairs.append(f"{t}:{min(ms, key=lambda r: ms[r])}")
    return ",".join(pairs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="only the mirrored kernel per shape; fewer whole-model rungs")
    ap.add_argument("--whole-only", action="store_true", help="skip part 1 (per shape)")
    ap.add_argument("--blocks", default="1,5,9", help="tokens per whole-model forward (one sequence), comma-separated")
    ap.add_argument(
        "--outs",
        default="1,2,4",
        help="outputs per warp of the whole-model kernel runs (0: the launch settings configured by row count)",
    )
    ap.add_argument(
        "--chained", action="store_true", help="also each forward chained as decode steps it (not wide-kernel)"
    )
    ap.add_argument("--profile-build", type=int, default=0, help="profile building steps and blocks: top N")
    ap.add_argument("--only", default="", help="whole-model rungs whose names start so (comma-separated; wide always)")
    a = ap.parse_args()
    install()
    print("implementation", rowkernel.implementation(), "usable", rowkernel.usable(), flush=True)
    loaded = load(a.model)
    report: dict[str, Any] = {"usable": rowkernel.usable(), "mirrored_usable": qmv_rows.usable()}
    print("mirrored usable", report["mirrored_usable"], flush=True)
    report["shapes"] = {} if a.whole_only else shapes(loaded.model, a.quick)
    blocks = tuple(int(t) for t in a.blocks.split(","))
    outs = tuple(int(r) for r in a.outs.split(","))
    report["whole_model"] = whole_model(
        loaded.model,
        loaded.info.vocab_size,
        quick=a.quick,
        blocks=blocks,
        outs=outs,
        chained=a.chained,
        only=tuple(x for x in a.only.split(",") if x),
    )
    if a.profile_build:
        report["build_profile"] = build_profile(loaded.model, loaded.info.vocab_size, a.profile_build)
    report["per_warp"] = best_per_warp(report["whole_model"], blocks, outs)
    print("fastest outputs per warp by rows (rows:outputs):", report["per_warp"], flush=True)
    report["mirrored_shapes"] = qmv_rows.report()
    print(json.dumps(report["whole_model"], indent=1))
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
