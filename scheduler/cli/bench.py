"""``mlx-batchd bench`` and ``bench-bursts``: the benchmarks' command lines.

The benchmarks themselves live in ``scheduler.bench``; this module holds only their options, so
``mlx-batchd --help`` stays fast and the benchmark code (and MLX) is imported when a benchmark runs.
"""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING, Any

from scheduler.cli.errors import CommandError, local_command
from scheduler.cli.options import Parser, int_list, non_negative_float, positive_float, positive_int

if TYPE_CHECKING:
    from scheduler.bench.env_arms import EnvArm

#: Where ``bench`` and ``bench-bursts`` write, relative to the current directory (never the package).
BENCH_OUT = "mlx-batchd-bench"


def add_bursts_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``bench-bursts``."""
    p = sub.add_parser(
        "bench-bursts", help="verify cost per level, B = 1 bursts vs classic, batched decode under a process-wide pin"
    )
    p.add_argument("--model", default="demo")
    p.add_argument(
        "--draft", action="append", default=[], help="drafter spec (repeatable): directory, demo, prompt-lookup"
    )
    p.add_argument("--mtp", default=None)
    p.add_argument(
        "-k", type=positive_int, default=None, help="drafted tokens a round; default serve's: 7 for an MTP head, else 4"
    )
    p.add_argument("--ks", type=int_list(1), default="2,3,4,5,6,7,8", help="K values for the verify-cost table")
    p.add_argument("--batch-sizes", type=int_list(1), default="2,4,8,16,32")
    p.add_argument("--tokens", type=positive_int, default=128, help="tokens per B = 1 request")
    p.add_argument("--batched-tokens", type=positive_int, default=64)
    p.add_argument("--batched-repeats", type=positive_int, default=2, help="runs per arm and batch size (best kept)")
    p.add_argument("--prompt-tokens", type=positive_int, default=32)
    p.add_argument("--context", type=positive_int, default=300, help="cache length for the verify-cost table")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--process-level", default="narrow", choices=["narrow", "per-query"])
    p.add_argument("--out", default=BENCH_OUT, help=f"folder for the results (default ./{BENCH_OUT})")
    p.set_defaults(func=local_command("bench-bursts", run_bursts))


def shell_words(text: str) -> list[str]:
    """``--daemon-args`` as the words a shell would split it into."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"cannot split {text!r} into options: {exc}") from None


def env_arm(text: str) -> EnvArm:
    """``--env-arm``'s value, checked against the ``MLX_BATCHD_*`` registry as it is parsed."""
    from scheduler.bench.env_arms import EnvArmError, parse_env_arm

    try:
        return parse_env_arm(text)
    except EnvArmError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class EnvArms(argparse.Action):
    """Collects ``--env-arm`` values; a name given twice is refused like any bad value."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, *_: Any) -> None:
        arms = list(getattr(namespace, self.dest, None) or [])
        if any(a.name == values.name for a in arms):
            raise argparse.ArgumentError(self, f"arm name {values.name!r} given twice")
        setattr(namespace, self.dest, [*arms, values])


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``bench``."""
    p = sub.add_parser(
        "bench", help="workload matrix: batched raw / engine / daemon, B = 1 bursts per drafter, Poisson, probe"
    )
    p.add_argument("--model", default="demo")
    p.add_argument(
        "--batch-sizes",
        type=int_list(1),
        default="1,4,8,16,32,64,128",
        help="comma list of B (default 1,4,8,16,32,64,128); the daemons and the engine get --max-batch of the largest (at least 32), so no B queues",
    )
    p.add_argument("--tokens", type=positive_int, default=128, help="tokens generated per sequence")
    p.add_argument("--prompt-tokens", type=positive_int, default=32)
    p.add_argument(
        "--prompts",
        choices=("random", "demo", "rewrite"),
        default="random",
        help="random: --prompt-tokens random token ids a request; demo: the demo command's file-like openings "
        "(what the demo pair was trained on: its MTP head accepts far less on random ids); rewrite: chats "
        "whose answer copies the prompt (rename a function in a file, summarise a document quoting it), "
        "rendered with the model's chat template",
    )
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument(
        "--min-seconds",
        type=non_negative_float,
        default=0.0,
        help="after --repeats, repeat a batch size (all its arms) until each arm's timed runs add up to this "
        "many seconds, at most 4x --repeats: cheap batch sizes get more repeats (default 0: off)",
    )
    p.add_argument(
        "--out", default=BENCH_OUT, help=f"folder for JSON, Markdown and PNG results (default ./{BENCH_OUT})"
    )
    p.add_argument(
        "--drafters",
        "--draft",
        default="",
        help="comma list of drafters for the B = 1 burst rows, one daemon each: DIR, demo, prompt-lookup, mtp:DIR|mtp:demo; a suffix @K sets that arm's drafted tokens a round (mtp:demo@8)",
    )
    p.add_argument(
        "--poisson-rate",
        type=non_negative_float,
        default=0.0,
        help="also run mixed Poisson arrivals at this rate/s",
    )
    p.add_argument("--poisson-requests", type=positive_int, default=40)
    p.add_argument(
        "--poisson-tokens",
        type=positive_int,
        default=None,
        help="every Poisson request asks for this many tokens (default: budgets drawn from 8 to --tokens)",
    )
    p.add_argument(
        "--daemon-args",
        type=shell_words,
        default=[],
        help="extra 'mlx-batchd serve' options for every daemon the bench starts, as one shell-quoted string "
        "after '=' (e.g. --daemon-args='--admit-window-ms 0'); recorded in the report",
    )
    p.add_argument(
        "--process-pin",
        default=None,
        choices=["narrow", "per-query"],
        help="also measure a daemon whose pin at this level covers the whole process (the cost scoping avoids)",
    )
    p.add_argument(
        "--env-arm",
        type=env_arm,
        action=EnvArms,
        default=[],
        metavar="NAME:VAR=VALUE[,VAR=VALUE]",
        help="also measure, at every B, a daemon like the daemon arm's started with these MLX_BATCHD_* "
        "variables (or serve options as --OPTION=VALUE), as arm NAME (lowercase letters, digits, hyphens), beside "
        "the daemon arm in the tables and the plot with its ratio to it (repeatable; e.g. "
        "mlx-kernels:MLX_BATCHD_W4A16=0, dense:--dense-shadow=on); recorded in the report",
    )
    p.add_argument(
        "--restart-times",
        action="store_true",
        help="after the timed runs and every daemon stopped, start the daemon arm's daemon again with the same "
        "options (its caches now warm on this machine) and report that second start's seconds from spawn to ready "
        "and to the first token of one short request (every daemon's first start is reported anyway)",
    )
    p.add_argument(
        "--via",
        default="zeromq",
        choices=["zeromq", "http"],
        help="http: the daemon arm's daemon also serves --http on a free loopback port, and two arms measure it "
        "through that OpenAI-compatible door (whole answers, SSE streams) beside the ZeroMQ arm",
    )
    p.add_argument(
        "--bandwidth-gbs",
        type=non_negative_float,
        default=0.0,
        help="memory bandwidth in GB/s for the physical reference beside each row; 0 (default): the vendor's peak "
        "for a device it knows by name (an H200: 4800), else none",
    )
    p.add_argument(
        "--raw-max-batch",
        type=positive_int,
        default=None,
        help="run the raw BatchGenerator arm only up to this B (it is the slowest arm at large B); default: every B",
    )
    g = p.add_argument_group(
        "prefix cache scenario",
        "--prefix-scenario runs these instead of the matrix, through a daemon with --prefix-cache-mb and one "
        "without: TTFT of a long shared prefix cold vs warm, a multi-turn chat's prefill tokens computed, "
        "and throughput with no hit (--prefix-batch sequences of --prompt-tokens, --tokens each)",
    )
    g.add_argument("--prefix-scenario", action="store_true", help="run the prefix cache scenario (issue 17)")

    def prefix_parts(text: str) -> str:
        """A comma list of the scenario's parts, kept in their running order."""
        parts = ("ttft", "chat", "throughput")
        chosen = [x.strip() for x in text.split(",")]
        if not chosen or any(x not in parts for x in chosen):
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(parts)}, got {text!r}")
        return ",".join(x for x in parts if x in chosen)

    g.add_argument(
        "--prefix-parts",
        type=prefix_parts,
        default="ttft,chat,throughput",
        help="which parts to run (comma list of ttft, chat, throughput; default all)",
    )
    g.add_argument("--prefix-cache-mb", type=positive_float, default=512.0, help="the cache daemon's --prefix-cache-mb")
    g.add_argument(
        "--prefix-allow-inexact",
        action="store_true",
        help="start the cache daemon with --allow-inexact: reuse even where the start-up check finds warm "
        "prefill not byte-identical to cold (the results say so)",
    )
    g.add_argument("--prefix-tokens", type=positive_int, default=2000, help="the shared prefix's length")
    g.add_argument("--suffix-tokens", type=positive_int, default=50, help="each request's own suffix after it")
    g.add_argument(
        "--warm-requests", type=positive_int, default=4, help="requests with new suffixes after each cold one"
    )
    g.add_argument("--chat-turns", type=positive_int, default=10)
    g.add_argument("--chat-system-tokens", type=positive_int, default=200, help="the chat's first message")
    g.add_argument("--chat-user-tokens", type=positive_int, default=40, help="each new user message")
    g.add_argument("--chat-answer-tokens", type=positive_int, default=60, help="max_tokens of each answer")
    g.add_argument(
        "--prefix-batch", type=positive_int, default=16, help="B of the throughput arms (distinct random prompts)"
    )
    p.set_defaults(func=local_command("bench", run))


def run(args: argparse.Namespace) -> int:
    """Run the workload matrix (or the prefix cache scenario)."""
    from clients import ClientError
    from scheduler.bench import main
    from scheduler.bench.output import BenchError

    try:
        return main(args)
    except BenchError as exc:
        raise CommandError(str(exc)) from None
    except ClientError as exc:  # a daemon failed a call outside an arm's run (its stats, its wait for idle)
        raise CommandError(f"a daemon failed a call: {exc}") from None


def run_bursts(args: argparse.Namespace) -> int:
    """Run the bursts benchmark inside one engine."""
    from scheduler.bench.bursts import main

    return main(args)
