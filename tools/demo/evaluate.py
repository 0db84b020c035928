"""Measure the shipped demo models: decode speed, held-out loss and speculative acceptance per drafter.

Why: the model card (docs/demo-models.md) must carry numbers anyone can re-measure on their machine.
Acceptance is greedy speculative decoding's: each round the drafter proposes K tokens, the target
verifies them in one forward over K + 1 positions and keeps the longest prefix that matches its own
argmax (plus its bonus token); acceptance = accepted drafted tokens / drafted tokens. The decoded text
is also compared with plain greedy decoding of the target, which it must equal.

Prompts are held-out code: function definitions from the held-out stdlib files (see
``tools.demo.corpus.HELDOUT_FILES``), each with up to ~1200 characters of the file before it.

Run from the repository root: ``python -m tools.demo.evaluate`` (prints Markdown tables).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

from tools.demo.corpus import default_stdlib, read_source, select_files
from workers.models import mtp as mtp_mod
from workers.models.demo import SHIPPED as WEIGHTS

# Prompts end right after the ``:``. The first shipped set needed that (its BPE merged a newline with the
# indentation after it, so a prompt ending in a bare "\n" ended on a boundary training never showed);
# the byte-level set does not, and the prompts stay the same so that the sets' numbers compare.
SAMPLE_PROMPT = "def fibonacci(n):"
_DEF_LINE = re.compile(r"^[ \t]*def \w+\(.*$", re.M)


# -------------------------------------------------------------------------------------------- prompts


def heldout_prompts(stdlib: Path, n: int, context_chars: int = 1200) -> list[str]:
    """``n`` prompts ending with a ``def`` line of a held-out file, evenly spread over all such lines."""
    corpus = select_files(stdlib)
    cands: list[str] = []
    for rel in corpus.heldout:
        text = read_source(stdlib / rel) or ""
        for m in _DEF_LINE.finditer(text):
            if not m.group(0).rstrip().endswith(":"):
                continue  # a signature spread over several lines: the prompt would stop mid-signature
            start = text.rfind("\n", 0, max(0, m.start() - context_chars)) + 1
            cands.append(text[start : m.end()].rstrip())
    idx = np.linspace(0, len(cands) - 1, num=min(n, len(cands))).round().astype(int)
    return [cands[i] for i in idx]


# ------------------------------------------------------------------------------------------- drafters


class Drafter(Protocol):
    """Proposes ``k`` tokens after the committed sequence, then learns how many were accepted."""

    def start(self, prompt_hidden: mx.array, committed: list[int]) -> None: ...

    def propose(self, committed: list[int], k: int) -> list[int]: ...

    def accepted(self, committed: list[int], n_accepted: int, k: int, verify_hidden: mx.array) -> None: ...


class DraftModelDrafter:
    """A small LM with its own KV cache; it only ever caches tokens that are committed or just drafted."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache: list = []
        self.cached: list[int] = []  # token ids whose keys/values are in the cache, in order

    def start(self, prompt_hidden: mx.array, committed: list[int]) -> None:
        self.cache = make_prompt_cache(self.model)
        self.cached = []

    def propose(self, committed: list[int], k: int) -> list[int]:
        missing = committed[len(self.cached) :]
        logits = self.model(mx.array([missing]), cache=self.cache)
        self.cached = list(committed)
        out: list[int] = []
        for i in range(k):
            tok = mx.argmax(logits[0, -1]).item()
            out.append(tok)
            if i + 1 < k:
                logits = self.model(mx.array([[tok]]), cache=self.cache)
                self.cached.append(tok)
        return out

    def accepted(self, committed: list[int], n_accepted: int, k: int, verify_hidden: mx.array) -> None:
        # The cache holds committed_before + drafts[:k-1]; keep what is still a prefix of `committed`.
        keep = 0
        for a, b in zip(self.cached, committed):
            if a != b:
                break
            keep += 1
        for c in self.cache:
            c.trim(len(self.cached) - keep)
        self.cached = self.cached[:keep]


class MTPDrafter:
    """The MTP head: fed the target's true hidden states, chained on its own for the rest of a draft."""

    def __init__(self, head: mtp_mod.MTPHead):
        self.head = head
        self.cache: list = []
        self.pending_hidden: mx.array | None = None
        self.pending_tokens: list[int] = []

    def start(self, prompt_hidden: mx.array, committed: list[int]) -> None:
        # Positions 0..P-1 of the prompt, each paired with the token after it (the last: the first
        # generated token, which is committed before the first round).
        self.cache = self.head.make_cache()
        self.pending_hidden = prompt_hidden
        self.pending_tokens = committed[1:]

    def propose(self, committed: list[int], k: int) -> list[int]:
        toks = mx.array([self.pending_tokens])
        drafted = self.head.draft(self.pending_hidden, toks, self.cache, k)
        return drafted[0].tolist()

    def accepted(self, committed: list[int], n_accepted: int, k: int, verify_hidden: mx.array) -> None:
        mtp_mod.trim_cache(self.cache, k - 1)  # the chained entries were speculative
        self.pending_hidden = verify_hidden[:, : n_accepted + 1]
        self.pending_tokens = committed[-(n_accepted + 1) :]


# ----------------------------------------------------------------------------------------- decoding


@dataclass
class DecodeStats:
    tokens: list[int]
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    rejections: int = 0  # rounds that ended at a drafted token the target did not pick


def greedy(target: nn.Module, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding, one token per forward: the reference speculative decoding must equal."""
    cache = make_prompt_cache(target)
    logits = target(mx.array([prompt]), cache=cache)
    out: list[int] = []
    while len(out) < max_new:
        tok = mx.argmax(logits[0, -1]).item()
        out.append(tok)
        if tok in eos:
            break
        logits = target(mx.array([[tok]]), cache=cache)
    return out


def speculative(
    target: nn.Module, drafter: Drafter, prompt: list[int], max_new: int, k: int, eos: set[int]
) -> DecodeStats:
    """Greedy speculative decoding; the target's cache always holds all committed tokens but the last."""
    cache = make_prompt_cache(target)
    logits, hidden = mtp_mod.target_forward(target, mx.array([prompt]), cache)
    committed = list(prompt) + [mx.argmax(logits[0, -1]).item()]
    drafter.start(hidden, committed)
    st = DecodeStats(tokens=[])
    while len(committed) - len(prompt) < max_new and committed[-1] not in eos:
        drafts = drafter.propose(committed, k)
        block = mx.array([[committed[-1]] + drafts])
        logits, hidden = mtp_mod.target_forward(target, block, cache)
        best = mx.argmax(logits[0], axis=-1).tolist()
        a = 0
        while a < k and drafts[a] == best[a] and drafts[a] not in eos:
            a += 1
        for c in cache:
            c.trim(k - a)
        committed += drafts[:a] + [best[a]]
        st.drafted += k
        st.accepted += a
        st.rounds += 1
        st.rejections += a < k
        drafter.accepted(committed, a, k, hidden)
    st.tokens = committed[len(prompt) :]
    return st


def _cut(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


# ------------------------------------------------------------------------------------------ metrics


def decode_speed(model: nn.Module, prompt: list[int], n: int) -> float:
    """Classic greedy tokens/s at B = 1 with mlx-lm's ``generate_step`` (prefill excluded, warm-up run)."""
    for _ in generate_step(mx.array(prompt), model, max_tokens=16):
        pass
    t0 = None
    count = 0
    for _ in generate_step(mx.array(prompt), model, max_tokens=n):
        count += 1
        if count == 1:
            t0 = time.perf_counter()
    return (count - 1) / (time.perf_counter() - t0)


def heldout_ce(model: nn.Module, ids: list[int], seq: int, windows: int) -> float:
    """Mean next-token cross-entropy over the first ``windows`` non-overlapping held-out windows."""
    total, n = 0.0, 0
    for i in range(windows):
        w = ids[i * seq : i * seq + seq + 1]
        if len(w) < seq + 1:
            break
        x = mx.array([w])
        logits = model(x[:, :-1]).astype(mx.float32)
        total += nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum").item()
        n += seq
    return total / n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", type=Path, default=WEIGHTS)
    p.add_argument("--stdlib", type=Path, default=None, help="stdlib root the held-out files come from")
    p.add_argument("--ks", default="2,3,4,5,6")
    p.add_argument("--prompts", type=int, default=16)
    # 256 bytes: about the text that 64 tokens of the first shipped set's BPE (3.4 bytes/token) covered.
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--speed-tokens", type=int, default=256)
    p.add_argument("--loss-windows", type=int, default=8, help="held-out 512-token windows for CE (0: skip)")
    p.add_argument("--sample-tokens", type=int, default=96)
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    stdlib = args.stdlib or default_stdlib()

    target, tokenizer = load(str(args.weights / "target"))
    draft, _ = load(str(args.weights / "draft"))
    head = mtp_mod.load_mtp(args.weights / "mtp", target)
    eos = set(tokenizer.eos_token_ids)
    results: dict = {"weights": str(args.weights), "ks": ks}

    sample_ids = tokenizer.encode(SAMPLE_PROMPT)
    if not args.no_speed:
        results["tok_s"] = {
            "target": decode_speed(target, sample_ids, args.speed_tokens),
            "draft": decode_speed(draft, sample_ids, args.speed_tokens),
        }
    sample = greedy(target, sample_ids, args.sample_tokens, eos)
    results["sample"] = SAMPLE_PROMPT + tokenizer.decode(sample)

    if args.loss_windows:
        corpus = select_files(stdlib)
        ids: list[int] = []
        for rel in corpus.heldout:
            ids += tokenizer.encode(read_source(stdlib / rel) or "") + [min(eos)]
        results["heldout_ce"] = {
            name: heldout_ce(m, ids, 512, args.loss_windows) for name, m in (("target", target), ("draft", draft))
        }
        results["heldout_ce"]["tokens"] = args.loss_windows * 512

    prompts = [tokenizer.encode(t) for t in heldout_prompts(stdlib, args.prompts)]
    refs = [greedy(target, pr, args.new_tokens, eos) for pr in tqdm(prompts, desc="greedy reference")]
    drafters = {"draft model": DraftModelDrafter(draft), "MTP head": MTPDrafter(head)}
    table: dict[str, dict[int, dict]] = {name: {} for name in drafters}
    with tqdm(total=len(drafters) * len(ks) * len(prompts), desc="speculative") as bar:
        for name, drafter in drafters.items():
            for k in ks:
                drafted = accepted = rounds = rejections = generated = mismatches = 0
                for pr, ref in zip(prompts, refs):
                    st = speculative(target, drafter, pr, args.new_tokens, k, eos)
                    drafted += st.drafted
                    accepted += st.accepted
                    rounds += st.rounds
                    rejections += st.rejections
                    generated += len(st.tokens)
                    mismatches += _cut(st.tokens, args.new_tokens, eos) != ref
                    bar.update(1)
                table[name][k] = {
                    "acceptance": accepted / drafted,
                    "tokens_per_round": 1 + accepted / rounds,  # drafted tokens kept plus the bonus
                    # Per-position acceptance alpha (Leviathan et al.): the chance a drafted token is accepted
                    # given that every token before it in the round was; the geometric model's estimate.
                    "alpha": accepted / (accepted + rejections) if accepted + rejections else 0.0,
                    "equal_to_greedy": len(prompts) - mismatches,
                }
    results["acceptance"] = table
    results["prompts"] = len(prompts)
    _print_markdown(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


def _print_markdown(r: dict, args: argparse.Namespace) -> None:
    if "tok_s" in r:
        print(f"\nClassic greedy decode, B = 1, bf16, mlx-lm generate_step, {args.speed_tokens} tokens:\n")
        print("| model | tokens/s |\n|---|---|")
        for name, v in r["tok_s"].items():
            print(f"| {name} | {v:.1f} |")
    if "heldout_ce" in r:
        print(f"\nHeld-out cross-entropy (nats/token, first {r['heldout_ce']['tokens']} held-out tokens):\n")
        print("| model | CE |\n|---|---|")
        for name in ("target", "draft"):
            print(f"| {name} | {r['heldout_ce'][name]:.3f} |")
    n = r["prompts"]
    print(f"\nGreedy speculative decoding, {n} held-out code prompts, {args.new_tokens} new tokens each:\n")
    names = list(r["acceptance"])
    print(
        "| K | "
        + " | ".join(f"{m}: acceptance | {m}: alpha | {m}: tokens/round" for m in names)
        + " | equal to greedy |"
    )
    print("|---|" + "---|---|---|" * len(names) + "---|")
    for k in r["ks"]:
        cells = []
        for m in names:
            c = r["acceptance"][m][k]
            cells += [f"{c['acceptance']:.3f}", f"{c['alpha']:.3f}", f"{c['tokens_per_round']:.2f}"]
        eq = min(r["acceptance"][m][k]["equal_to_greedy"] for m in names)
        print(f"| {k} | " + " | ".join(cells) + f" | {eq}/{n} |")
    print(f"\nGreedy sample ({args.sample_tokens} tokens):\n\n```python\n{r['sample']}\n```")


if __name__ == "__main__":
    main()
