"""``bench --prefix-scenario``: the prefix cache scenario (``run_prefix``). TTFT of a shared prefix cold
vs warm, a multi-turn chat's prefill, throughput with no hit, each through a daemon with the cache and
one without; the tables are ``prefix_report``'s."""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.bench.arms import random_prompts, run_daemon, step_counters, wait_idle
from scheduler.bench.output import BenchError, progress
from scheduler.bench.prefix_report import (
    PREFIX_TARGETS,
    prefix_chat_rows,
    prefix_throughput_row,
    prefix_ttft_rows,
    write_prefix,
)
from scheduler.bench.spreads import rotated

#: Tokens each TTFT request of the prefix scenario generates; only the first is timed.
TTFT_TOKENS = 4
#: The prefix scenario's daemons: with ``--prefix-cache-mb``, and the same daemon without it.
PREFIX_ARMS = ("no_cache", "cache")
#: The prefix scenario's parts (``--prefix-parts``), in the order they run.
PREFIX_PARTS = ("ttft", "chat", "throughput")


@dataclass(frozen=True)
class PrefixPlan:
    """The prefix scenario's shapes (``bench --prefix-scenario`` flags)."""

    prefix: int
    suffix: int
    warm: int
    turns: int
    system: int
    user: int
    answer: int
    batch: int
    prompt_tokens: int
    tokens: int
    repeats: int
    parts: tuple[str, ...] = PREFIX_PARTS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PrefixPlan:
        chosen = set(getattr(args, "prefix_parts", ",".join(PREFIX_PARTS)).split(","))
        return cls(
            prefix=args.prefix_tokens,
            suffix=args.suffix_tokens,
            warm=args.warm_requests,
            turns=args.chat_turns,
            system=args.chat_system_tokens,
            user=args.chat_user_tokens,
            answer=args.chat_answer_tokens,
            batch=args.prefix_batch,
            prompt_tokens=args.prompt_tokens,
            tokens=args.tokens,
            repeats=args.repeats,
            parts=tuple(p for p in PREFIX_PARTS if p in chosen),
        )

    @property
    def max_tokens_cap(self) -> int:
        """The daemons' ``--max-tokens-cap``: the largest budget any part asks for."""
        return max(
            TTFT_TOKENS if "ttft" in self.parts else 1,
            self.answer if "chat" in self.parts else 1,
            self.tokens if "throughput" in self.parts else 1,
        )

    def too_long(self, context: int) -> str | None:
        """Why a part does not fit the model's context (the daemon refuses prompt + max_tokens past
        it), with the largest setting that does; ``None`` when every part fits."""
        ttft = self.prefix + self.suffix + TTFT_TOKENS
        if "ttft" in self.parts and ttft > context:
            room = context - self.suffix - TTFT_TOKENS
            return (
                f"--prefix-tokens {self.prefix} + --suffix-tokens {self.suffix} + {TTFT_TOKENS} generated tokens "
                f"exceed the model's context ({context}); use --prefix-tokens {room} or less"
            )
        chat = self.system + self.turns * (self.user + self.answer)
        if "chat" in self.parts and chat > context:
            return (
                f"a {self.turns}-turn chat ({self.system} + {self.turns} x ({self.user} + {self.answer}) = {chat} "
                f"tokens) exceeds the model's context ({context}); shorten --chat-* or use fewer --chat-turns"
            )
        if "throughput" in self.parts and self.prompt_tokens + self.tokens > context:
            return f"--prompt-tokens + --tokens exceed the model's context ({context})"
        return None

    def steps(self) -> int:
        """Timed requests and runs, for the progress lines: TTFT requests, chat conversations (one per
        daemon), throughput runs (one per daemon)."""
        per_repeat = {"ttft": 1 + self.warm, "chat": 2, "throughput": 2}
        return self.repeats * sum(per_repeat[p] for p in self.parts)


def _random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, min(vocab, 256)) for _ in range(n)]


def prefix_counters(client: Any) -> dict[str, int]:
    """What the prefix scenario reads from a daemon's ``stats``: the prompt tokens every tenant was
    served (every prompt token, cached or not) and the prefix cache's counters (0 without a cache)."""
    stats = client.stats()
    cache = stats["engine"].get("prefix_cache") or {}
    served = sum(int(t.get("served_prompt_tokens", 0)) for t in (stats.get("tenants") or {}).values())
    counts = {k: int(cache.get(k, 0)) for k in ("queries", "hits", "hit_tokens", "lookup_tokens", "evictions")}
    return {"served_prompt_tokens": served, **counts}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def timed_request(client: Any, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy request: the client's time to its first token (submit to the first token
    event), the daemon's own ``ttft_s``, the tokens, and what the request moved in ``stats``."""
    from clients.events import EndEvent, TokenEvent

    before = prefix_counters(client)
    out: list[int] = []
    first: float | None = None
    end: EndEvent | None = None
    sent = time.perf_counter()
    for ev in client.stream(tokens=tokens, max_tokens=max_tokens):
        if isinstance(ev, TokenEvent):
            if ev.tokens and first is None:
                first = time.perf_counter() - sent
            out.extend(ev.tokens)
        else:
            end = ev
    seconds = time.perf_counter() - sent
    if end is None or end.error is not None:
        raise RuntimeError(f"a prefix scenario request failed: {end.error if end else 'no end event'}")
    moved = _delta(prefix_counters(client), before)
    return {
        "prompt_tokens": len(tokens),
        "ttft_s": first if first is not None else seconds,
        "daemon_ttft_s": end.timings.get("ttft_s"),
        "seconds": seconds,
        "tokens": out,
        "hit_tokens": moved["hit_tokens"],
        "computed_tokens": moved["served_prompt_tokens"] - moved["hit_tokens"],
    }


def run_chat(client: Any, system: list[int], users: list[list[int]], answer_tokens: int) -> dict[str, Any]:
    """A chat replayed as a chat client sends it: every turn's prompt is the whole conversation so far
    (the first message, each earlier user message and the model's answer to it) and a new user
    message. Per turn: prompt tokens, tokens taken from the cache and prefilled (from ``stats``)."""
    convo = list(system)
    turns = []
    tic = time.perf_counter()
    for i, user in enumerate(users):
        prompt = convo + user
        r = timed_request(client, prompt, answer_tokens)
        turns.append({"turn": i + 1, **{k: v for k, v in r.items() if k != "tokens"}, "answer": r["tokens"]})
        convo = prompt + r["tokens"]
    return {
        "seconds": time.perf_counter() - tic,
        "turns": turns,
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "hit_tokens": sum(t["hit_tokens"] for t in turns),
        "computed_tokens": sum(t["computed_tokens"] for t in turns),
    }


def run_prefix(args: argparse.Namespace) -> int:
    """``bench --prefix-scenario``: TTFT cold vs warm, a multi-turn chat's prefill, throughput at no hit
    (``--prefix-parts``, each written to the tables as it finishes).

    Two daemons: ``cache`` (``--prefix-cache-mb``) and ``no_cache``, started alike. Every TTFT request
    runs alone on an idle daemon; the first request of each new prefix is the cold one, the next
    ``--warm-requests`` send the same prefix with new suffixes. Each conversation runs on both daemons
    (order rotated), so the cache-less prefill is read from a daemon that has no cache, and the two
    daemons' answers are compared token for token. The throughput arms rotate like the matrix's."""
    import mlx.core as mx

    from clients.sync import Client
    from scheduler.spawn import DaemonProcess

    plan = PrefixPlan.from_args(args)
    out = Path(args.out)
    tmp = Path(tempfile.mkdtemp(prefix="mlx-batchd-bench-"))
    common = ["--max-tokens-cap", str(plan.max_tokens_cap), "--max-batch", str(max(32, plan.batch))]
    cache = [*common, "--prefix-cache-mb", f"{args.prefix_cache_mb:g}"]
    no_cache = [*common, "--prefix-cache-mb", "0"]  # serve's default is a prefix cache
    daemons = {"no_cache": no_cache, "cache": [*cache, "--allow-inexact"] if args.prefix_allow_inexact else cache}
    meta: dict[str, Any] = {
        "model": args.model,
        "device": str(mx.default_device()),
        "mlx": str(getattr(mx, "__version__", "unknown")),
        "prefix_cache_mb": args.prefix_cache_mb,
        "allow_inexact": args.prefix_allow_inexact,
        "prefix_tokens": plan.prefix,
        "suffix_tokens": plan.suffix,
        "ttft_tokens": TTFT_TOKENS,
        "warm_requests": plan.warm,
        "chat_turns": plan.turns,
        "chat_system_tokens": plan.system,
        "chat_user_tokens": plan.user,
        "chat_answer_tokens": plan.answer,
        "batch": plan.batch,
        "prompt_tokens": plan.prompt_tokens,
        "tokens": plan.tokens,
        "repeats": plan.repeats,
        "targets": PREFIX_TARGETS,
        "parts": list(plan.parts),
        "parts_done": [],
        "complete": False,
    }
    result: dict[str, Any] = {"meta": meta}
    done = 0
    total = plan.steps()

    def step(line: str) -> None:
        nonlocal done
        done += 1
        progress(f"bench prefix [{done}/{total}] {line}")

    def finished(part: str) -> None:
        meta["parts_done"].append(part)
        meta["complete"] = tuple(meta["parts_done"]) == plan.parts
        write_prefix(result, out)
        progress(f"bench prefix: {part} done, tables in {out}")

    with contextlib.ExitStack() as stack:
        progress(f"bench prefix: starting 2 daemons: {', '.join(daemons)}")
        procs = {
            name: stack.enter_context(DaemonProcess(args.model, f"ipc://{tmp / f'{name}.sock'}", *extra))
            for name, extra in daemons.items()
        }
        clients = {name: stack.enter_context(Client(proc.address, timeout=3600)) for name, proc in procs.items()}
        model = clients["cache"].health()["model"]
        context, vocab = int(model["context_length"]), int(model["vocab_size"])
        meta["context_length"] = context
        if (why := plan.too_long(context)) is not None:
            raise BenchError(why)
        snapshot = clients["cache"].stats()["engine"].get("prefix_cache") or {}
        meta["prefix_cache"] = {k: snapshot.get(k) for k in ("serving", "max_bytes", "verdict")}
        if not snapshot.get("serving"):
            print(
                f"warning: the cache daemon's prefix cache is not serving: {snapshot.get('verdict')}", file=sys.stderr
            )
        wait_idle(clients)
        for part in plan.parts:
            PREFIX_RUNNERS[part](plan, clients, vocab, result, step)
            finished(part)
    exit_codes = {name: proc.proc.returncode for name, proc in procs.items()}
    for name, code in exit_codes.items():
        if code != 0:
            print(f"warning: the '{name}' daemon exited with {code} after SIGTERM", file=sys.stderr)
    meta["daemon_exit_codes"] = exit_codes
    print(write_prefix(result, out))
    print(f"results in {out.resolve()}", flush=True)
    return 0


def _prefix_ttft(
    plan: PrefixPlan, clients: dict[str, Any], vocab: int, result: dict[str, Any], step: Callable[[str], None]
) -> None:
    """TTFT through the cache daemon, one request at a time: the first request of each new prefix
    (cold), then ``plan.warm`` with new suffixes (warm). An untimed prefix first: its cold and one
    warm request pay first-use costs."""
    cache = clients["cache"]
    rng = random.Random(17)
    progress("bench prefix: TTFT warm-up (untimed)")
    warm_up = _random_tokens(rng, plan.prefix, vocab)
    for _ in range(2):
        timed_request(cache, warm_up + _random_tokens(rng, plan.suffix, vocab), TTFT_TOKENS)
    requests: list[dict[str, Any]] = []
    for rep in range(plan.repeats):
        prefix = _random_tokens(rng, plan.prefix, vocab)
        for i in range(1 + plan.warm):
            wait_idle(clients)
            r = timed_request(cache, prefix + _random_tokens(rng, plan.suffix, vocab), TTFT_TOKENS)
            kind = "cold" if i == 0 else "warm"
            requests.append({"repeat": rep, "kind": kind, **{k: v for k, v in r.items() if k != "tokens"}})
            step(
                f"TTFT prefix {rep + 1}/{plan.repeats}, {kind}: {r['ttft_s'] * 1e3:.1f} ms "
                f"({r['hit_tokens']} of {r['prompt_tokens']} tokens from the cache)"
            )
    result["ttft_requests"] = requests
    result["ttft"] = prefix_ttft_rows(requests)


def _prefix_chat(
    plan: PrefixPlan, clients: dict[str, Any], vocab: int, result: dict[str, Any], step: Callable[[str], None]
) -> None:
    """Each conversation on both daemons, in an order rotated per repeat; a first message and user
    messages of their own per conversation, so no conversation starts from another's entries."""
    progress("bench prefix: chat warm-up (untimed)")
    for arm in PREFIX_ARMS:
        timed_request(clients[arm], _random_tokens(random.Random(98), plan.system + plan.user, vocab), plan.answer)
    chats = []
    for rep in range(plan.repeats):
        crng = random.Random(1700 + rep)
        system = _random_tokens(crng, plan.system, vocab)
        users = [_random_tokens(crng, plan.user, vocab) for _ in range(plan.turns)]
        chat: dict[str, Any] = {}
        for arm in rotated(list(PREFIX_ARMS), rep):
            wait_idle(clients)
            chat[arm] = run_chat(clients[arm], system, users, plan.answer)
            step(
                f"chat {rep + 1}/{plan.repeats}, {arm}: {chat[arm]['computed_tokens']} of "
                f"{chat[arm]['prompt_tokens']} prompt tokens prefilled in {chat[arm]['seconds']:.2f} s"
            )
        chats.append(chat)
    result["chats"] = chats
    result["chat_rows"] = prefix_chat_rows(chats)


def _prefix_throughput(
    plan: PrefixPlan, clients: dict[str, Any], vocab: int, result: dict[str, Any], step: Callable[[str], None]
) -> None:
    """The matrix's workload at ``plan.batch`` (distinct random prompts: nothing to reuse) on both
    daemons, rotated per repeat; the cache daemon's hits during the timed runs are counted."""
    progress(f"bench prefix: throughput warm-up at B = {plan.batch} (untimed)")
    for arm in PREFIX_ARMS:
        run_daemon(clients[arm], random_prompts(plan.batch, plan.prompt_tokens, vocab, seed=99), min(8, plan.tokens))
    samples: dict[str, list[float]] = {}
    runs = []
    before = prefix_counters(clients["cache"])
    for rep in range(plan.repeats):
        prompts = random_prompts(plan.batch, plan.prompt_tokens, vocab, seed=17_000 + rep)
        for position, arm in enumerate(rotated(list(PREFIX_ARMS), rep)):
            wait_idle(clients)
            before_steps = step_counters(clients[arm].stats()["engine"])
            n, wall = run_daemon(clients[arm], prompts, plan.tokens)
            after_steps = step_counters(clients[arm].stats()["engine"])
            samples.setdefault(arm, []).append(n / wall)
            # The engine's own steps during the run: wall time beyond them is the daemon's, not the engine's.
            steps = {k: after_steps[k] - before_steps[k] for k in after_steps}
            runs.append({"repeat": rep, "position": position, "arm": arm, "tokens": n, "seconds": wall, "steps": steps})
            step(f"B = {plan.batch}, repeat {rep + 1}/{plan.repeats}, {arm}: {n / wall:.1f} tok/s")
    moved = _delta(prefix_counters(clients["cache"]), before)
    result["throughput_runs"] = runs
    result["throughput"] = prefix_throughput_row(
        samples, plan.batch, {k: moved[k] for k in ("hits", "hit_tokens", "lookup_tokens")}, runs
    )


#: ``--prefix-parts`` -> the function that runs it and stores its results.
PREFIX_RUNNERS: dict[str, Callable[[PrefixPlan, dict[str, Any], int, dict[str, Any], Callable[[str], None]], None]] = {
    "ttft": _prefix_ttft,
    "chat": _prefix_chat,
    "throughput": _prefix_throughput,
}
