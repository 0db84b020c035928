"""The ``mlx-batchd`` command. Client subcommands import no MLX; ``serve`` loads it lazily."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clients.address import default_address
from clients.protocol import DEFAULT_MAX_FRAME_BYTES

# File-like openings: the byte-level demo model learnt from windows that start mid-file, so a bare
# one-line prompt leaves it guessing the indentation; a line or two of context settles it.
DEMO_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "import os\n\n\ndef read_config(path):\n",
    "def count_words(text):\n    counts = {}\n",
]


def _serve(args: argparse.Namespace) -> int:
    from scheduler.admission import Limits
    from scheduler.daemon import DaemonSettings, serve
    from scheduler.frontend import FrontEndSettings
    from workers.burst import BurstSettings
    from workers.loop import EngineSettings

    front = FrontEndSettings(
        listen=args.listen or default_address(),
        limits=Limits(max_tokens_cap=args.max_tokens_cap, default_max_tokens=args.default_max_tokens),
        max_frame_bytes=args.max_frame_bytes,
        drain_timeout=args.drain_timeout,
        max_queued=args.max_queued,
        tenants=Path(args.tenants) if args.tenants else None,
        curve_secret=Path(args.curve_secret) if args.curve_secret else None,
        insecure=args.insecure,
        metrics=args.metrics,
        kv_budget_bytes=int(args.kv_budget_mb * 2**20),
        max_inflight_per_client=args.max_inflight_per_client,
    )
    engine = EngineSettings(
        max_batch=args.max_batch,
        prefill_batch=args.prefill_batch,
        prefill_step=args.prefill_step,
        pin_scope=args.pin_scope,
        probe_k=args.probe_k,
        probe_policy=_probe_policy(args),
        draft=args.draft,
        mtp=args.mtp,
        bursts=BurstSettings(k=args.k, audit_fraction=args.audit_fraction),
    )
    settings = DaemonSettings(front, model=args.model, context_length=args.context_length, engine=engine)
    return serve(settings)


def _keys(args: argparse.Namespace) -> int:
    """``keys new NAME``: a CURVE keypair as pyzmq certificate files (NAME.key, NAME.key_secret)."""
    import zmq.auth

    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), args.name)
    Path(secret).chmod(0o600)
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def _client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"curve_secret": args.curve_secret, "server_key": args.server_key}


def no_reply(command: str, address: str, wait: float | None) -> str:
    within = f" within {wait:g}s" if wait else ""
    return f"mlx-batchd {command}: no reply from {address}{within} (is the daemon running?)"


def daemon_command(name: str, func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a subcommand that talks to a running daemon: an unreachable daemon or a client-side error
    becomes one line on stderr and exit 1 instead of a traceback, and Ctrl-C exits quietly."""
    from clients import ClientError

    def run(args: argparse.Namespace) -> int:
        address = getattr(args, "addr", None) or default_address()
        try:
            return func(args)
        except KeyboardInterrupt:
            return 130
        except TimeoutError:
            print(no_reply(name, address, getattr(args, "timeout", None)), file=sys.stderr)
            return 1
        except ClientError as exc:
            print(f"mlx-batchd {name}: {address}: {exc}", file=sys.stderr)
            return 1

    return run


def _add_client_auth(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curve-secret", default=None, help="your secret key file (NAME.key_secret)")
    p.add_argument("--server-key", default=None, help="the daemon's public key file")


def _probe_policy(args: argparse.Namespace) -> Any:
    from workers.kernels import Level
    from workers.probe import ProbePolicy

    return ProbePolicy(
        allow_inexact=args.allow_inexact,
        pinned_level=Level(args.pin_level) if args.pin_level else None,
        accept_classic_variation=args.accept_classic_variation,
        localize=getattr(args, "localize", False),
    )


def _add_probe_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-inexact",
        action="store_true",
        help="run bursts at wide even when no level is exact, marked inexact everywhere",
    )
    p.add_argument(
        "--pin-level",
        choices=["wide", "narrow", "per-query"],
        default=None,
        help="use this kernel level for verify instead of the ladder's choice",
    )
    p.add_argument(
        "--accept-classic-variation",
        action="store_true",
        help="where classic decode itself is not reproducible, accept a block no worse than its variation",
    )


def _probe(args: argparse.Namespace) -> int:
    from mlx_lm.models.cache import make_prompt_cache
    from tqdm import tqdm

    from workers.demo import cache_dir
    from workers.models import load
    from workers.probe import VerdictStore, iter_table, make_draws, probe, serving_pairing, sliding_window

    loaded = load(args.model)
    ks = [int(k) for k in args.k.split(",")]
    root = cache_dir()

    def make_cache() -> list[Any]:
        return make_prompt_cache(loaded.model)

    pairing = serving_pairing(Path(loaded.info.path), loaded.config, args.draft, make_cache(), root / "probe")
    store = None if args.no_store else VerdictStore(root / "verdicts")
    report: list[dict[str, Any]] = []
    for k in ks:
        draws = make_draws(k, loaded.info.vocab_size, loaded.info.context_length, sliding_window(loaded.config))
        with tqdm(desc=f"probe k={k}", unit="draw", file=sys.stderr, disable=args.json) as bar:
            verdict = probe(
                loaded.model,
                make_cache,
                pairing,
                draws,
                k,
                store,
                _probe_policy(args),
                progress=lambda label: _tick(bar, label),
                force=args.force,
            )
        report.append({"k": k, "verdict": verdict.to_json()})
        if not args.json:
            print(
                f"\nk = {k} drafted tokens (verify block of {k + 1}), model {loaded.info.name}, "
                f"{pairing['backend']['device']} {pairing['backend']['device_name']}"
            )
            print("| level | result | first position | draw | seconds |")
            print("|---|---|---|---|---|")
            for row in iter_table(verdict):
                print("| " + " | ".join(row) + " |")
            cached = " (memoised)" if verdict.from_cache else ""
            print(
                f"verdict: {verdict.level or 'declined'} ({'exact' if verdict.exact else 'inexact'}) - "
                f"{verdict.reason}; probe {verdict.probe_seconds:.2f}s{cached}"
            )
    widths = loaded.widths.widths
    if args.json:
        print(json.dumps({"model": loaded.info.name, "widths": widths, "probes": report}, indent=2))
    else:
        print("\nrow-exact widths (narrow level): " + ", ".join(f"{k}: {v}" for k, v in widths.items()))
    return 0


def _tick(bar: Any, label: str) -> None:
    bar.set_postfix_str(label)
    bar.update()


def _synth(args: argparse.Namespace) -> int:
    from workers.synthetic import PRESETS, write_model

    path = write_model(Path(args.out), PRESETS[args.preset], seed=args.seed)
    print(path)
    return 0


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop or None,
        "timeout": args.timeout,
    }


def _generate(args: argparse.Namespace) -> int:
    from clients import Client, EndEvent, TokenEvent

    kwargs = _sampling_kwargs(args)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    with Client(args.addr, **_client_kwargs(args)) as client:
        try:  # a missing daemon fails here, not after an endless wait for the first token
            client.health(timeout=args.connect_timeout)
        except TimeoutError:
            print(no_reply("generate", client.address, args.connect_timeout), file=sys.stderr)
            return 1
        for event in client.stream(prompt, **kwargs):
            if isinstance(event, TokenEvent):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, EndEvent):
                sys.stdout.write("\n")
                if event.error is not None:
                    print(f"error: {event.error}", file=sys.stderr)
                    return 1
                t = event.timings
                print(
                    f"[{event.finish_reason}] {event.usage.get('prompt_tokens')} prompt + "
                    f"{event.usage.get('completion_tokens')} generated tokens, "
                    f"ttft {t.get('ttft_s') or 0:.3f}s, decode {t.get('decode_s') or 0:.3f}s",
                    file=sys.stderr,
                )
    return 0


def _stats(args: argparse.Namespace) -> int:
    from clients import Client

    with Client(args.addr, timeout=args.timeout, **_client_kwargs(args)) as client:
        if args.measure_tax:
            client.stats(measure_tax=True)
            time.sleep(args.tax_wait)
        health, stats = client.health(), client.stats()
    if args.json:
        print(json.dumps({"health": health, "stats": stats}, indent=2))
    else:
        print(format_stats(health, stats))
    return 0


def format_stats(health: dict[str, Any], stats: dict[str, Any]) -> str:
    """A human summary of the ``stats`` reply."""
    e = stats.get("engine", {})
    b = e.get("bursts", {})
    p = e.get("pins", {})
    model = health.get("model") or {}
    lines = [
        f"mlx-batchd {health.get('status')}: model {model.get('name')} ({model.get('type')}, context "
        f"{model.get('context_length')}), up {stats.get('uptime_s', 0):.0f}s",
        f"requests: {stats.get('requests_in_flight', 0)} in flight, {stats.get('requests_waiting', 0)} waiting, "
        f"{stats.get('requests_completed', 0)} completed, {stats.get('messages_refused', 0)} refused",
        f"engine: {e.get('active_sequences', 0)} active, batch {e.get('batch_size', 0)} (peak {e.get('peak_batch_size', 0)}), "
        f"{e.get('generated_tokens', 0)} tokens generated, {e.get('decode_steps', 0)} decode steps",
    ]
    for name, t in stats.get("tenants", {}).items():
        lines.append(
            f"  tenant {name}: weight {t['weight']}, {t['active']} active, {t['waiting']} waiting, served "
            f"{t['served_prompt_tokens']} prompt + {t['served_generated_tokens']} generated tokens"
        )
    if b.get("drafter"):
        rate = b["accepted_tokens"] / b["drafted_tokens"] if b.get("drafted_tokens") else 0.0
        lines.append(
            f"bursts: {b['drafter']} k={b['k']}, {b['rounds']} rounds, acceptance {rate:.2f}, "
            f"declined {b.get('declined') or {}}, audits {b['audits']} ({b['audit_failures']} failed)"
        )
    for name, v in e.get("verdicts", {}).items():
        lines.append(
            f"verdict {name}: "
            + (
                f"{v['level'] or 'declined'} ({'exact' if v['exact'] else 'inexact'}) - {v['reason']}"
                if "level" in v
                else f"probing ({v.get('at')})"
            )
        )
    tax = e.get("pin_tax") or {}
    if tax:
        lines.append(
            f"pin tax: batch {tax['batch']} at {tax['level']}: {tax['ratio']:.3f}x a wide step; scoping saved "
            f"~{tax['estimated_seconds_saved_by_scoping']:.2f}s of batched decode so far"
        )
    lines.append(
        f"pins ({e.get('pin_scope')}): "
        + ", ".join(
            f"{r['level']}/{r['purpose']} {r['forwards']} forwards {r['seconds']:.2f}s" for r in p.get("pinned", [])
        )
        + f"; collateral {p.get('collateral_forwards', 0)} forwards, {p.get('collateral_seconds', 0.0):.2f}s"
    )
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    """The main job on the embedded default: a daemon on the demo model with its MTP head as the
    drafter; one request alone (B = 1: speculative bursts), then concurrent requests (batched)."""
    from concurrent.futures import ThreadPoolExecutor

    from clients import Client, TokenEvent
    from scheduler.spawn import DaemonProcess

    extra = (
        [] if args.drafter == "none" else (["--mtp", "demo"] if args.drafter == "mtp" else ["--draft", args.drafter])
    )
    sock_dir = Path(tempfile.mkdtemp(prefix="mlx-batchd-demo-"))
    daemon = DaemonProcess(args.model, f"ipc://{sock_dir / 'daemon.sock'}", *extra)
    print(f"$ {' '.join(daemon.cmd)}", flush=True)
    try:
        health = daemon.wait_ready()
        print(f"daemon ready: {health['model']}")
        with Client(daemon.address) as client:
            _wait_for_verdict(client)
            print(
                f"\n--- one request alone (B = 1, speculative bursts when the probe allows):\n{DEMO_PROMPTS[0]}", end=""
            )
            tic = time.perf_counter()
            n = 0
            for event in client.stream(DEMO_PROMPTS[0], max_tokens=args.max_tokens):
                if isinstance(event, TokenEvent):
                    print(event.text, end="", flush=True)
                    n += len(event.tokens)
            alone = time.perf_counter() - tic
            print(f"\n[{n} tokens in {alone:.2f}s, {n / alone:.1f} tok/s]")
            tic = time.perf_counter()
            with ThreadPoolExecutor(len(DEMO_PROMPTS)) as pool:
                results = list(pool.map(lambda p: client.generate(p, max_tokens=args.max_tokens), DEMO_PROMPTS))
            wall = time.perf_counter() - tic
            for prompt, r in zip(DEMO_PROMPTS, results):
                print(
                    f"\n--- {prompt.splitlines()[0]!r}... -> {r.finish_reason}, {r.usage['completion_tokens']} tokens, "
                    f"ttft {r.timings['ttft_s']:.3f}s\n{prompt}{r.text}"
                )
            total = sum(r.usage["completion_tokens"] for r in results)
            print(f"\n{len(results)} concurrent requests, {total} tokens in {wall:.2f}s ({total / wall:.1f} tok/s)")
            engine = client.stats()["engine"]
            b = engine["bursts"]
            if b["drafter"]:
                rate = b["accepted_tokens"] / b["drafted_tokens"] if b["drafted_tokens"] else 0.0
                print(
                    f"bursts: drafter {b['drafter']}, {b['rounds']} rounds, acceptance {rate:.2f}, "
                    f"verdict {json.dumps(engine['verdicts'])}, pin collateral {engine['pins']['collateral_forwards']}"
                )
    finally:
        code = daemon.stop()
    print(f"daemon exited with {code}")
    return code


def _wait_for_verdict(client: Any, timeout: float = 120.0) -> None:
    """Let the start-up probe finish (bursts wait for its verdict) so the demo shows them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        verdicts = client.stats()["engine"]["verdicts"]
        if not verdicts or all("level" in v for v in verdicts.values()):
            return
        time.sleep(0.1)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the whole request")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-batchd", description="A batching daemon for MLX models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--model", default="demo", help="a local mlx-lm model directory, or 'demo' (default)")
    p.add_argument("--listen", default=None, help=f"ZeroMQ address to bind (default {default_address()})")
    p.add_argument("--max-batch", type=int, default=32, help="most sequences decoded together")
    p.add_argument("--prefill-batch", type=int, default=8, help="most prompts prefilled together")
    p.add_argument("--prefill-step", type=int, default=2048, help="prompt tokens per prefill chunk")
    p.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--context-length", type=int, default=None, help="override the model's context length")
    p.add_argument("--max-frame-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=0.0,
        help="on SIGTERM/SIGINT, let in-flight requests finish for up to this many seconds",
    )
    p.add_argument(
        "--pin-scope",
        choices=["scoped", "process"],
        default="scoped",
        help="scoped: only verify forwards run pinned; process: every forward (the seed's way, for comparison)",
    )
    p.add_argument(
        "--probe-k",
        type=int,
        default=None,
        help="without a drafter: probe the verify pairing for K drafted tokens at start-up",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="speculative drafter for B = 1 bursts: a draft model directory, 'demo' or 'prompt-lookup'",
    )
    p.add_argument("--mtp", default=None, help="an MTP head directory (or 'demo') as the drafter")
    p.add_argument("-k", type=int, default=4, help="drafted tokens per burst round (the verify block is K + 1)")
    p.add_argument(
        "--audit-fraction",
        type=float,
        default=0.02,
        help="fraction of burst rounds re-checked against a single-token forward",
    )
    p.add_argument("--max-queued", type=int, default=1024, help="requests waiting for a slot before `busy`")
    p.add_argument("--tenants", default=None, help="tenants TOML file (keys, weights, limits); reloaded on SIGHUP")
    p.add_argument("--curve-secret", default=None, help="the daemon's CURVE secret key file")
    p.add_argument("--insecure", action="store_true", help="allow tcp:// without authentication (not recommended)")
    p.add_argument(
        "--kv-budget-mb",
        type=float,
        default=0.0,
        help="KV cache the admitted requests may reserve (prompt + max_tokens each); 0 = no cap",
    )
    p.add_argument(
        "--max-inflight-per-client",
        type=int,
        default=256,
        help="requests one connection may have in flight before `busy`",
    )
    p.add_argument("--metrics", default=None, help="serve Prometheus metrics on HOST:PORT (e.g. 127.0.0.1:9464)")
    _add_probe_policy(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("probe", help="measure whether a verify block is byte-identical to classic decode, per level")
    p.add_argument("--model", default="demo")
    p.add_argument("--draft", default="none", help="the drafter of the pairing (part of the verdict's fingerprint)")
    p.add_argument("-k", default="4", help="drafted tokens per round; a comma list probes several (2,3,4)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--localize", action="store_true", help="name the first layer/op that diverges")
    p.add_argument("--force", action="store_true", help="re-probe even when a memoised verdict exists")
    p.add_argument("--no-store", action="store_true", help="neither read nor write memoised verdicts")
    _add_probe_policy(p)
    p.set_defaults(func=_probe)

    p = sub.add_parser("bench-bursts", help="verify cost per level, B = 1 bursts vs classic, batched pin tax")
    p.add_argument("--model", default="demo")
    p.add_argument(
        "--draft", action="append", default=[], help="drafter spec (repeatable): directory, demo, prompt-lookup"
    )
    p.add_argument("--mtp", default=None)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--ks", default="2,3,4,5,6,7,8", help="K values for the verify-cost table")
    p.add_argument("--batch-sizes", default="2,4,8,16,32")
    p.add_argument("--tokens", type=int, default=128, help="tokens per B = 1 request")
    p.add_argument("--batched-tokens", type=int, default=64)
    p.add_argument("--batched-repeats", type=int, default=2, help="runs per arm and batch size (best kept)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=300, help="cache length for the verify-cost table")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--process-level", default="narrow", choices=["narrow", "per-query"])
    p.add_argument("--out", default="docs/bench")
    p.set_defaults(func=lambda a: __import__("scheduler.bench_bursts", fromlist=["main"]).main(a))

    p = sub.add_parser("synth", help="write a random-weight model directory from a preset config")
    p.add_argument("--preset", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_synth)

    p = sub.add_parser("generate", help="send one prompt to a running daemon and stream the answer")
    p.add_argument("prompt")
    p.add_argument("--addr", default=None, help="daemon address (default: the local ipc socket)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    p.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds the daemon has to answer a health check first"
    )
    _add_sampling(p)
    _add_client_auth(p)
    p.set_defaults(func=daemon_command("generate", _generate))

    p = sub.add_parser("stats", help="print a running daemon's health and counters")
    p.add_argument("--addr", default=None)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--json", action="store_true", help="the raw health and stats replies")
    p.add_argument("--measure-tax", action="store_true", help="time a batched step pinned vs wide first")
    p.add_argument("--tax-wait", type=float, default=2.0, help="seconds to let that measurement run")
    _add_client_auth(p)
    p.set_defaults(func=daemon_command("stats", _stats))

    p = sub.add_parser("keys", help="CURVE keys for tenants and the daemon")
    keys = p.add_subparsers(dest="keys_command", required=True)
    k = keys.add_parser("new", help="write NAME.key (public) and NAME.key_secret")
    k.add_argument("name")
    k.add_argument("--dir", default=".")
    k.set_defaults(func=_keys)

    p = sub.add_parser("demo", help="start a daemon on the demo model and run concurrent jobs through it")
    p.add_argument("--model", default="demo")
    p.add_argument("--max-tokens", type=int, default=160, help="per request (the demo model's tokens are bytes)")
    p.add_argument(
        "--drafter", default="mtp", help="mtp (the demo MTP head), demo (draft model), prompt-lookup or none"
    )
    p.set_defaults(func=_demo)

    p = sub.add_parser("bench", help="workload matrix: batched daemon vs raw, B = 1 bursts per drafter, Poisson, probe")
    p.add_argument("--model", default="demo")
    p.add_argument("--batch-sizes", default="1,4,8,16")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="docs/bench", help="folder for JSON, Markdown and PNG results")
    p.add_argument(
        "--drafters",
        "--draft",
        default="",
        help="comma list of drafters for the B = 1 burst rows, one daemon each: DIR, demo, prompt-lookup, mtp:DIR|mtp:demo",
    )
    p.add_argument("--poisson-rate", type=float, default=0.0, help="also run mixed Poisson arrivals at this rate/s")
    p.add_argument("--poisson-requests", type=int, default=40)
    p.add_argument(
        "--process-pin",
        default=None,
        choices=["narrow", "per-query"],
        help="also measure a daemon with --pin-scope process at this level (the tax scoping avoids)",
    )
    p.set_defaults(func=lambda a: __import__("scheduler.bench", fromlist=["main"]).main(a))
    __import__("scheduler.top", fromlist=["add_parser"]).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
