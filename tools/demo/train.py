"""Train the demo model set: a target LM, a small draft LM and an MTP head, all with MLX.

Why it exists: ``mlx-batchd serve --model demo`` must produce recognisable text on any machine, offline,
and speculative decoding must show real acceptance, so the repository ships a small, genuinely trained
target with two drafters. Everything here is deterministic given ``--seed`` and the step counts (data
order and initialisation are seeded; GPU reductions may still differ in the last bits).

Corpus: the ``.py`` files of a CPython standard library (by default the running interpreter's), minus
generated data modules and a fixed held-out set (see ``tools.demo.corpus.select_files``). Nothing is downloaded.

Phases (each saves its result as soon as it ends):

1. tokenizer: bytes (257 tokens with EOS; ``--vocab-size N`` fits a byte-level BPE of N instead);
2. target: llama-style, trained from scratch on next-token cross-entropy, then cast to bf16 (what ships);
3. draft: a shallow llama distilled from the bf16 target (soft cross-entropy against its distribution),
   because acceptance is agreement with the target, not with the data. By default it starts as the
   target's embedding, first ``--draft-layers`` blocks and final norm (an early exit of the target), so
   distillation refines a model that already agrees with the target instead of learning from nothing;
4. MTP head: distilled from the bf16 target's next-next-token distribution, trained chained to depth
   ``--mtp-depth`` exactly as it is used in drafting (see ``tools.demo.objectives.mtp_chain``).

Step counts: give ``--target-steps`` etc. for a reproducible run; or a time budget per phase
(``--target-seconds`` ...), in which case the first steps are timed during warm-up (whose learning rate
does not depend on the total) and the count is fixed from them and recorded in the report. Either way
the report (``train_report.json``) records the exact counts, so a rerun with them is the same run.

Run from the repository root: ``python -m tools.demo.train`` (writes ``workers/models/demo/weights``, the shipped
set, unless ``--out`` says otherwise; see docs/demo-models.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

from tools.demo.corpus import def_prompt_ends, default_stdlib, encode_files, read_source, select_files
from tools.demo.models import (
    DRAFT_SHAPE,
    MTP_LAYERS,
    SEQ_LEN,
    SMOKE_SHAPES,
    TARGET_SHAPE,
    VOCAB_SIZE,
    as_shipped,
    draft_from_target,
    llama_args,
    n_params,
    save_llama,
)
from tools.demo.objectives import ce_loss, distill_loss, eval_windows, lm_metrics, mtp_loss, mtp_metrics, sample_windows
from tools.demo.phases import PhaseSpec, batches, file_starts, generate_pool, mixed_batches, train_phase
from tools.demo.tokenizer import BYTE_VOCAB_SIZE, EOS_TOKEN, train_tokenizer
from workers.models import mtp as mtp_mod
from workers.models.demo import SHIPPED


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=SHIPPED, help="default: the shipped set, workers/models/demo/weights")
    p.add_argument("--stdlib", type=Path, default=None, help="stdlib root (default: this interpreter's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-files", type=int, default=0, help="use only the first N training files (smoke tests)")
    p.add_argument("--mtp-depth", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help=f"{BYTE_VOCAB_SIZE}: bytes; more: a BPE")
    p.add_argument("--target-layers", type=int, default=0, help="0: the default shape's depth")
    # Default budgets fit one 10-minute device call; batches of 32 x 1536 bytes.
    for name, lr, batch, secs, cap in (
        ("target", 2e-3, 32, 230.0, 8000),
        ("draft", 3e-3, 32, 90.0, 6000),
        ("mtp", 2e-3, 32, 130.0, 6000),
    ):
        p.add_argument(f"--{name}-lr", type=float, default=lr)
        p.add_argument(f"--{name}-batch", type=int, default=batch)
        p.add_argument(f"--{name}-steps", type=int, default=0, help="0: fix from --*-seconds")
        p.add_argument(f"--{name}-seconds", type=float, default=secs)
        p.add_argument(f"--{name}-max-steps", type=int, default=cap)
    # Default none: on a fresh H200 compiling a phase's step cost ~70 s, more than the compiled target
    # step (28.5 ms vs 36.8 ms uncompiled) saves in a few-minute phase.
    p.add_argument("--compile", default="", help="comma list of phases whose step is mx.compile'd (target,draft,mtp)")
    # Pool rows are prompt + continuation = SEQ_LEN + 1 tokens, so drafters train on full-length windows.
    p.add_argument("--pool-seqs", type=int, default=49152, help="on-policy greedy continuations for the drafters")
    p.add_argument("--pool-prompt", type=int, default=1281)
    p.add_argument("--pool-gen", type=int, default=256)
    p.add_argument("--pool-batch", type=int, default=1024)
    p.add_argument("--pool-seconds", type=float, default=45.0)
    p.add_argument("--pool-def-fraction", type=float, default=0.5, help="share of pool prompts ending at a def line")
    p.add_argument("--pool-share", type=float, default=0.75, help="share of each drafter batch drawn from the pool")
    p.add_argument(
        "--file-start-share", type=float, default=0.0, help="share of real training windows that begin a file"
    )
    p.add_argument("--draft-init", choices=("target", "scratch"), default="target", help="target: early exit of it")
    p.add_argument(
        "--draft-layers", type=int, default=3, help="blocks of the target the draft keeps (--draft-init target)"
    )
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=0, help="cap held-out windows (0: all)")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--smoke", action="store_true", help="tiny shapes: test this script, not a real run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    log_lines: list[str] = []

    def log(msg: str) -> None:
        line = f"{time.perf_counter() - t_start:7.1f}s {msg}"
        print(line, flush=True)
        log_lines.append(line)

    mx.random.seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    root = (args.stdlib or default_stdlib()).resolve()
    corpus = select_files(root)
    train_files = corpus.train[: args.max_files] if args.max_files else corpus.train
    log(f"device {mx.default_device()}, stdlib {root}: {len(train_files)} train files, {len(corpus.heldout)} held-out")

    texts = (read_source(root / f) or "" for f in train_files)
    tok = train_tokenizer(texts, args.vocab_size)
    eos_id = tok.token_to_id(EOS_TOKEN)
    train_tokens = encode_files(tok, root, train_files)
    heldout_tokens = encode_files(tok, root, corpus.heldout)
    train_bytes = sum((root / f).stat().st_size for f in train_files)
    log(
        f"tokenizer: {tok.get_vocab_size()} tokens; train {len(train_tokens)} tokens "
        f"({train_bytes / len(train_tokens):.2f} bytes/token), held-out {len(heldout_tokens)}"
    )

    seq = args.seq_len
    target_shape, draft_shape = SMOKE_SHAPES if args.smoke else (TARGET_SHAPE, DRAFT_SHAPE)
    if args.target_layers:
        target_shape = dict(target_shape, num_hidden_layers=args.target_layers)
    vocab = tok.get_vocab_size()
    held_wins = eval_windows(heldout_tokens, seq, args.eval_windows or None)
    train_wins = sample_windows(train_tokens, seq, len(held_wins) or 8, seed=args.seed + 1)
    compiled = set(args.compile.split(",")) if args.compile else set()
    report: dict = {
        "command": " ".join(
            [Path(sys.executable).name, "-m", "tools.demo.train"] + (argv if argv is not None else sys.argv[1:])
        ),
        "seed": args.seed,
        "python_running": platform.python_version(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "stdlib_root": str(root),
        "corpus": {
            "digest": corpus.digest() if not args.max_files else None,
            "train_files": len(train_files),
            "train_bytes": train_bytes,
            "train_tokens": int(len(train_tokens)),
            "heldout_files": list(corpus.heldout),
            "heldout_tokens": int(len(heldout_tokens)),
            "heldout_windows": len(held_wins),
        },
        "vocab_size": vocab,
        "file_start_share": args.file_start_share,
        "seq_len": seq,
    }

    def phase_spec(name: str) -> PhaseSpec:
        a = vars(args)
        return PhaseSpec(
            name=name,
            lr=a[f"{name}_lr"],
            batch=a[f"{name}_batch"],
            steps=a[f"{name}_steps"],
            seconds=a[f"{name}_seconds"],
            warmup=args.warmup,
            max_steps=a[f"{name}_max_steps"],
        )

    # ---- target
    starts = file_starts(train_tokens, eos_id)
    target = llama.Model(llama_args(vocab, target_shape))
    mx.eval(target.parameters())
    spec = phase_spec("target")
    rng = np.random.default_rng(args.seed)
    curve: list[dict] = []

    def heldout_point(step: int) -> None:
        target.eval()
        curve.append({"step": step, "heldout_ce": lm_metrics(target, held_wins)["ce"]})
        target.train()
        log(f"[target] step {step}: held-out CE {curve[-1]['heldout_ce']:.4f}")

    res = train_phase(
        spec,
        seq,
        target,
        ce_loss,
        batches(train_tokens, spec.batch, seq, rng, starts, args.file_start_share),
        [],
        "target" in compiled,
        log,
        every=(args.eval_every, heldout_point),
    )
    as_shipped(target)  # the draft and the head learn from this exact model
    save_llama(target, out / "target", tok, eos_id)
    report["target"] = {
        "shape": target_shape,
        "params": n_params(target),
        "train": asdict(res),
        "heldout_curve": curve,
        "heldout": lm_metrics(target, held_wins),
        "train_sample": lm_metrics(target, train_wins),
    }
    log(
        f"target: held-out CE {report['target']['heldout']['ce']:.4f}, train-sample CE {report['target']['train_sample']['ce']:.4f}"
    )
    _write_report(out, report, log_lines)

    # ---- on-policy pool for the drafters
    t_pool = time.perf_counter()
    def_ends = def_prompt_ends(tok, root, train_files) if args.pool_def_fraction > 0 else None
    pool = generate_pool(
        target,
        train_tokens,
        args.pool_seqs,
        args.pool_prompt,
        args.pool_gen,
        args.pool_batch,
        np.random.default_rng(args.seed + 4),
        args.pool_seconds,
        log,
        def_ends=def_ends,
        def_fraction=args.pool_def_fraction,
    )
    report["pool"] = {
        "seqs": int(len(pool)),
        "def_fraction": args.pool_def_fraction,
        "share_of_drafter_batches": args.pool_share,
        "prompt": args.pool_prompt,
        "gen": args.pool_gen,
        "seconds": time.perf_counter() - t_pool,
    }
    pool_wins = list(pool[-64:])  # the last rows: a sample for on-policy agreement metrics, never trained on
    pool_train = pool[:-64] if len(pool) > 128 else pool
    dseq = pool.shape[1] - 1

    # ---- draft
    if args.draft_init == "target":
        draft, draft_shape = draft_from_target(target, target_shape, args.draft_layers)
    else:
        draft = llama.Model(llama_args(vocab, draft_shape))
    mx.eval(draft.parameters())
    report["draft_init"] = {"from": args.draft_init, "layers": draft_shape["num_hidden_layers"]}
    if args.draft_init == "target":  # what the early exit agrees on before distillation, for the report
        report["draft_init"]["on_policy_sample"] = lm_metrics(draft, pool_wins, teacher=target)
        log(f"draft init: on-policy agree {report['draft_init']['on_policy_sample']['top1_agree_target']:.3f}")
    spec = phase_spec("draft")
    rng = np.random.default_rng(args.seed + 2)
    res = train_phase(
        spec,
        dseq,
        draft,
        partial(distill_loss, teacher=target),
        mixed_batches(train_tokens, pool_train, spec.batch, rng, args.pool_share, starts, args.file_start_share),
        [target.state],
        "draft" in compiled,
        log,
    )
    as_shipped(draft)
    save_llama(draft, out / "draft", tok, eos_id)
    report["draft"] = {
        "shape": draft_shape,
        "params": n_params(draft),
        "train": asdict(res),
        "heldout": lm_metrics(draft, held_wins, teacher=target),
        "train_sample": lm_metrics(draft, train_wins, teacher=target),
        "on_policy_sample": lm_metrics(draft, pool_wins, teacher=target),
    }
    log(
        f"draft: held-out CE {report['draft']['heldout']['ce']:.4f}, agree {report['draft']['heldout']['top1_agree_target']:.3f}"
        f", on-policy agree {report['draft']['on_policy_sample']['top1_agree_target']:.3f}"
    )
    _write_report(out, report, log_lines)

    # ---- MTP head
    head = mtp_mod.MTPHead(mtp_mod.head_config_for(target, num_hidden_layers=MTP_LAYERS), target)
    mx.eval(head.parameters())
    spec = phase_spec("mtp")
    rng = np.random.default_rng(args.seed + 3)
    res = train_phase(
        spec,
        dseq,
        head,
        partial(mtp_loss, target=target, depth=args.mtp_depth),
        mixed_batches(train_tokens, pool_train, spec.batch, rng, args.pool_share, starts, args.file_start_share),
        [target.state],
        "mtp" in compiled,
        log,
    )
    as_shipped(head)
    mtp_mod.save_mtp(head, out / "mtp")
    report["mtp"] = {
        "layers": MTP_LAYERS,
        "depth_trained": args.mtp_depth,
        "params": n_params(head),
        "train": asdict(res),
        "heldout": mtp_metrics(head, target, held_wins, args.mtp_depth),
        "train_sample": mtp_metrics(head, target, train_wins, args.mtp_depth),
        "on_policy_sample": mtp_metrics(head, target, pool_wins, args.mtp_depth),
    }
    log(
        f"mtp: held-out agree by depth {[round(x, 3) for x in report['mtp']['heldout']['top1_agree_target']]}"
        f", on-policy {[round(x, 3) for x in report['mtp']['on_policy_sample']['top1_agree_target']]}"
    )

    # ---- round trip through the loaders the daemon uses
    from mlx_lm import load as mlx_lm_load

    t_loaded, tokenizer = mlx_lm_load(str(out / "target"))
    mtp_mod.load_mtp(out / "mtp", t_loaded)
    sample_ids = tokenizer.encode("def fibonacci(n):\n")
    report["roundtrip"] = {"eos_token_ids": sorted(tokenizer.eos_token_ids), "sample_prompt_tokens": len(sample_ids)}
    report["seconds_total"] = time.perf_counter() - t_start
    log(f"done in {report['seconds_total']:.0f}s")
    _write_report(out, report, log_lines)
    return report


def _write_report(out: Path, report: dict, log_lines: list[str]) -> None:
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "train.log").write_text("\n".join(log_lines) + "\n")


if __name__ == "__main__":
    main()
