"""The ``mlx-batchd`` command. Client subcommands import no MLX; ``serve`` loads it lazily.

A user mistake never ends in a traceback or a silent wait. Options are range-checked by the parser
(one line, exit 2); what only shows when a command runs (a path that is not a model, an address
without ``ipc://``, a key file that is not there, no daemon at the address) is one line naming the
problem and the fix, exit 1. Both wrappers, ``daemon_command`` and ``local_command``, are that one place.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from clients.address import IPC_PREFIX, default_address, ipc_path
from clients.protocol import DEFAULT_MAX_FRAME_BYTES

if TYPE_CHECKING:
    from clients import Client

# File-like openings: the byte-level demo model learnt from windows that start mid-file, so a bare
# one-line prompt leaves it guessing the indentation; a line or two of context settles it.
DEMO_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "import os\n\n\ndef read_config(path):\n",
    "def count_words(text):\n    counts = {}\n",
]

#: After Ctrl-C, how long cancelling the request and closing the connection may take before the
#: command exits anyway (a daemon that is gone must not keep the terminal).
CLOSE_WITHIN_S = 2.0
#: Where ``bench`` and ``bench-bursts`` write, relative to the current directory (never the package).
BENCH_OUT = "mlx-batchd-bench"


# ---------------------------------------------------------------------------------------------- option types


def _span(what: str, lo: float | None, hi: float | None, above: bool = False) -> str:
    """``an integer >= 1``, ``a number in (0, 1]``: the range an option accepts, for its error."""

    def num(x: float) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"

    if lo is not None and hi is not None:
        return f"{what} in {'(' if above else '['}{num(lo)}, {num(hi)}]"
    if lo is not None:
        return f"{what} {'>' if above else '>='} {num(lo)}"
    assert hi is not None
    return f"{what} <= {num(hi)}"


def int_in(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]`` (``None``: unbounded on that side)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {_span('an integer', lo, hi)}, got {value}")
        return value

    parse.__name__ = _span("an integer", lo, hi)
    return parse


def float_in(lo: float, hi: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``[lo, hi]``, or ``(lo, hi]`` when ``above``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = value > lo if above else value >= lo
        if not (math.isfinite(value) and low_ok and (hi is None or value <= hi)):
            raise argparse.ArgumentTypeError(f"must be {_span('a number', lo, hi, above)}, got {text}")
        return value

    parse.__name__ = _span("a number", lo, hi, above)
    return parse


def int_list(lo: int = 1) -> Callable[[str], str]:
    """An argparse ``type``: a comma list of integers >= ``lo`` (``2,3,4``), kept as the text the
    commands split themselves."""

    def parse(text: str) -> str:
        items = [item.strip() for item in text.split(",")]
        try:
            values = [int(item) for item in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers (e.g. 2,3,4), got {text!r}") from None
        if any(v < lo for v in values):
            raise argparse.ArgumentTypeError(f"every item must be an integer >= {lo}, got {text!r}")
        return ",".join(str(v) for v in values)

    parse.__name__ = f"a comma list of integers >= {lo}"
    return parse


def http_address(text: str) -> str:
    """An argparse ``type``: ``HOST:PORT`` for ``--http`` (port 0 picks a free one)."""
    from scheduler.http_auth import split_host_port

    try:
        split_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None
    return text


def host_port(text: str) -> str:
    """An argparse ``type``: ``HOST:PORT`` (``:PORT`` alone means 127.0.0.1) with a port in 1..65535."""
    _, sep, port = text.rpartition(":")
    if not (sep and port.isdigit() and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:9464), got {text!r}"
        )
    return text


positive_int = int_in(1)
non_negative_int = int_in(0)
positive_float = float_in(0.0, above=True)
non_negative_float = float_in(0.0)
fraction = float_in(0.0, 1.0)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (the problem, then where the options are listed) instead
    of a usage block that, for ``serve``, would bury the one line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


# ---------------------------------------------------------------------------------------------- one-line errors


class CommandError(Exception):
    """A failure the user can act on (a bad address, a missing file, no daemon): its message names
    the problem and the fix, and the command prints it as one line and exits 1."""


def _address_and_source(given: str | None, option: str) -> tuple[str, str]:
    """The address a command will use and where it came from, for messages."""
    if given:
        return given, option
    if os.environ.get("MLX_BATCHD_ADDR"):
        return default_address(), "MLX_BATCHD_ADDR"
    return default_address(), "the default address"


def check_address(address: str, source: str) -> None:
    """Refuse an address that is not ``ipc://PATH`` or ``tcp://HOST:PORT``: ZeroMQ answers those
    with a bare ``Invalid argument`` traceback, and a plain path is the usual slip, so the message
    spells out the address that was probably meant."""
    if address.startswith(IPC_PREFIX):
        if len(address) == len(IPC_PREFIX):
            raise CommandError(f"{source} {address!r} names no socket file; write ipc:///PATH/TO/daemon.sock")
        return
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://") :].rpartition(":")
        if host and sep and port.isdigit() and 0 < int(port) < 65536:
            return
        raise CommandError(f"{source} {address!r}: a tcp address needs a host and a port, e.g. tcp://127.0.0.1:5555")
    looks_tcp = re.fullmatch(r"[\w.\-\[\]:*]+:\d+", address) is not None
    fix = f"tcp://{address}" if looks_tcp else f"{IPC_PREFIX}{Path(address).expanduser().absolute()}"
    raise CommandError(
        f"{source} {address!r} is not a ZeroMQ address; did you mean {fix}? (addresses start with ipc:// or tcp://)"
    )


def check_key_file(path: str, option: str, secret: bool) -> None:
    """A CURVE key file that exists and holds what ``option`` needs; pyzmq itself reports a
    missing file as an "Invalid certificate file"."""
    import zmq.auth

    if not Path(path).is_file():
        raise CommandError(f"{option} {path}: no such file (make a key pair with `mlx-batchd keys new NAME`)")
    try:
        _, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CommandError(f"{option} {path} is not a CURVE key file ({exc})") from None
    if secret and secret_key is None:
        raise CommandError(f"{option} {path} holds only a public key; give the NAME.key_secret file")


def check_client_keys(args: argparse.Namespace) -> None:
    """``--curve-secret`` and ``--server-key``: both or neither, each a readable key file."""
    secret, server = getattr(args, "curve_secret", None), getattr(args, "server_key", None)
    if (secret is None) != (server is None):
        raise CommandError(
            "give both --curve-secret (your NAME.key_secret) and --server-key (the daemon's public key), or neither"
        )
    if secret is not None and server is not None:
        check_key_file(secret, "--curve-secret", secret=True)
        check_key_file(server, "--server-key", secret=False)


def check_socket(address: str) -> None:
    """An ``ipc://`` address whose socket file is missing has no daemon behind it: say so at once,
    instead of letting ZeroMQ wait for one to appear."""
    path = ipc_path(address)
    if path is None:
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CommandError(
            f"no daemon at {address} (the socket file does not exist); start one with `mlx-batchd serve`"
        ) from None
    except OSError as exc:
        raise CommandError(f"cannot use {address}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise CommandError(f"{address}: {path} is not a socket; is --addr the daemon's --listen address?")


def _unreachable(address: str, wait: float | None, keys: bool) -> str:
    within = f" within {wait:g}s" if wait else ""
    if address.startswith("tcp://") and not keys:
        why = "is the daemon running? one with tenants also needs --curve-secret and --server-key"
    elif keys:
        why = "is the daemon running, and is --server-key its public key?"
    else:
        why = "is the daemon running?"
    return f"no reply from {address}{within} ({why})"


def no_reply(command: str, address: str, wait: float | None, keys: bool = False) -> str:
    return f"mlx-batchd {command}: {_unreachable(address, wait, keys)}"


def _request_error_line(address: str, exc: Exception) -> str:
    """A ``RequestError`` with the fix where the code has an obvious one."""
    line = f"{address}: {exc}"
    if getattr(exc, "code", None) == "unauthorized":
        line += " (check that --server-key is the daemon's public key and your public key is in its tenants file)"
    return line


def daemon_command(name: str, func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a subcommand that talks to a running daemon: a bad address or key file, a missing
    socket, an unreachable daemon or a client-side error becomes one line on stderr and exit 1
    instead of a traceback or a wait, and Ctrl-C exits 130."""
    import zmq

    from clients import ClientError

    def run(args: argparse.Namespace) -> int:
        address, source = _address_and_source(getattr(args, "addr", None), "--addr")
        keys = getattr(args, "curve_secret", None) is not None
        try:
            check_address(address, source)
            check_client_keys(args)
            check_socket(address)
            return func(args)
        except KeyboardInterrupt:
            return 130
        except CommandError as exc:
            return _fail(name, str(exc))
        except TimeoutError:
            return _fail(name, _unreachable(address, getattr(args, "timeout", None), keys))
        except ClientError as exc:
            return _fail(name, _request_error_line(address, exc))
        except zmq.ZMQError as exc:
            return _fail(name, f"{address}: {exc}")

    return run


#: Exceptions whose message is written for the user, with the exit code: 1 for what is missing or
#: does not load, 2 for a daemon configuration that is refused (the parser's code for bad options).
#: Looked up only in modules already imported, since one that was not cannot have raised: ``keys``
#: and ``demo`` never load MLX just to check an exception's type.
_USER_ERRORS = (
    ("workers.models", "ModelError", 1),
    ("workers.synthetic", "PresetError", 1),
    ("scheduler.spawn", "DaemonExited", 1),
    ("scheduler.frontend", "BindError", 1),  # before ConfigError, its base: first match wins
    ("scheduler.frontend", "ConfigError", 2),
    ("scheduler.tenants", "TenantsError", 2),
)


def _user_error_code(exc: BaseException) -> int | None:
    for module, name, code in _USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return code
    return None


def local_command(name: str, func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a subcommand that works on local things (serve, probe, synth, keys, bench, demo): a
    model path that is not a model, an unknown preset, a bad address or key file becomes one line on
    stderr and exit 1 (2 for a configuration the daemon refuses); Ctrl-C exits 130."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except KeyboardInterrupt:
            return 130
        except CommandError as exc:
            return _fail(name, str(exc))
        except Exception as exc:
            code = _user_error_code(exc)
            if code is None:
                raise
            return _fail(name, str(exc), code)

    return run


def _fail(name: str, message: str, code: int = 1) -> int:
    print(f"mlx-batchd {name}: {' '.join(message.split())}", file=sys.stderr)
    return code


@contextlib.contextmanager
def open_client(args: argparse.Namespace, request_id: str | None = None, **kwargs: Any) -> Iterator[Client]:
    """A ``Client`` for one command, closed on the way out. After Ctrl-C, ``request_id`` is
    cancelled and the client closed by a helper thread given ``CLOSE_WITHIN_S``: the interrupt can
    land in the middle of a call, and a daemon that is gone cannot answer the cancel, so waiting
    for either without a bound could keep the command from exiting."""
    from clients import Client

    client = Client(args.addr, **_client_kwargs(args), **kwargs)
    try:
        yield client
    except KeyboardInterrupt:
        _cancel_and_close(client, request_id, CLOSE_WITHIN_S)
        raise
    except BaseException:
        client.close()
        raise
    client.close()


def _cancel_and_close(client: Client, request_id: str | None, within: float) -> None:
    def finish() -> None:
        if request_id is not None:
            with contextlib.suppress(Exception):
                client.cancel(request_id)
        with contextlib.suppress(Exception):
            client.close()

    worker = threading.Thread(target=finish, name="mlx-batchd-cancel", daemon=True)
    worker.start()
    worker.join(within)


# ---------------------------------------------------------------------------------------------- commands


def _serve(args: argparse.Namespace) -> int:
    """Run the daemon. The address and key file are checked here, before MLX is imported; the model
    and drafters by ``scheduler.daemon.serve``, before the socket is bound."""
    listen, source = _address_and_source(args.listen, "--listen")
    check_address(listen, source)
    if args.curve_secret is not None:
        check_key_file(args.curve_secret, "--curve-secret", secret=True)

    from scheduler.admission import Limits
    from scheduler.daemon import DaemonSettings, serve
    from scheduler.frontend import FrontEndSettings
    from workers.burst import BurstSettings
    from workers.loop import EngineSettings

    front = FrontEndSettings(
        listen=listen,
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
        max_unsent_per_client=args.max_unsent_per_client,
        http=args.http,
        http_body_timeout_s=args.http_body_timeout,
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
        prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
    )
    settings = DaemonSettings(
        front,
        model=args.model,
        context_length=args.context_length,
        engine=engine,
        engine_process=not args.engine_thread,
    )
    return serve(settings)


def _keys(args: argparse.Namespace) -> int:
    """``keys new NAME``: a CURVE keypair as pyzmq certificate files (NAME.key, NAME.key_secret).
    An existing pair is kept unless ``--force``: replacing the server's pair locks out every client
    that holds the old public key."""
    import zmq.auth

    name = args.name
    if not name or Path(name).name != name or name in (".", ".."):
        raise CommandError(f"NAME {name!r} must be a plain file name (use --dir for the folder)")
    directory = Path(args.dir)
    existing = [p for p in (directory / f"{name}.key", directory / f"{name}.key_secret") if p.exists()]
    if existing and not args.force:
        raise CommandError(
            f"{existing[0]} already exists; replacing it locks out whoever holds the old public key "
            "(pass --force to replace it anyway)"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        public, secret = zmq.auth.create_certificates(str(directory), name)
        Path(secret).chmod(0o600)
    except OSError as exc:
        raise CommandError(f"cannot write keys to {directory}: {exc.strerror or exc}") from None
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def _keys_new_api(args: argparse.Namespace) -> int:
    """``keys new-api NAME``: a fresh HTTP API key, printed once, and the tenants.toml line holding its
    hash. The key itself is stored nowhere: whoever loses it makes a new one."""
    from scheduler.http_auth import key_digest, new_api_key

    name = args.name
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise CommandError(f"NAME {name!r} must be a tenant name of letters, digits, '_' and '-'")
    key = new_api_key()
    print(f"API key for tenant {name} (shown only now; give it to its user, keep it secret):")
    print(f"  {key}")
    print(f"Add its hash to [tenants.{name}] in the tenants file, then reload (kill -HUP) or restart:")
    print(f'  api_keys_sha256 = ["{key_digest(key)}"]')
    return 0


def _client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"curve_secret": args.curve_secret, "server_key": args.server_key}


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
    from workers.probe import (
        VerdictStore,
        iter_table,
        ladder_line,
        make_draws,
        narrowed_widths,
        probe,
        serving_pairing,
        sliding_window,
    )

    loaded = load(args.model)
    ks = [int(k) for k in args.k.split(",")]  # checked by the parser (int_list)
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
            print(f"ladder: {ladder_line(verdict)}")
            for path, (before, after) in narrowed_widths(verdict).items():
                print(f"calibration narrowed {path}: {before} -> {after} rows")
            print(
                f"verdict: {verdict.level or 'declined'} ({'exact' if verdict.exact else 'inexact'}) - "
                f"{verdict.reason}; probe {verdict.probe_seconds:.2f}s{cached}"
            )
    widths = loaded.widths.widths
    if args.json:
        print(json.dumps({"model": loaded.info.name, "widths": widths, "probes": report}, indent=2))
    else:
        print(
            "\nrow-exact widths measured at load on random inputs (the verdicts' calibrated widths serve): "
            + ", ".join(f"{k}: {v}" for k, v in widths.items())
        )
    return 0


def _tick(bar: Any, label: str) -> None:
    bar.set_postfix_str(label)
    bar.update()


def _synth(args: argparse.Namespace) -> int:
    from workers.synthetic import preset, write_model

    config = preset(args.preset)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = write_model(out, config, seed=args.seed)
    except OSError as exc:
        raise CommandError(f"cannot write {out}: {exc.strerror or exc}") from None
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
    """Stream one request to the terminal. One Ctrl-C cancels it and exits 130 (``CancelOnInterrupt``)."""
    kwargs = _sampling_kwargs(args)
    if args.priority is not None:
        kwargs["priority"] = args.priority
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    request_id = uuid.uuid4().hex
    with open_client(args, request_id) as client, CancelOnInterrupt(client, request_id) as interrupt:
        try:
            try:  # a daemon that does not answer fails here, not after an endless wait for the first token
                client.health(timeout=args.connect_timeout)
            except TimeoutError:
                keys = args.curve_secret is not None
                raise CommandError(_unreachable(client.address, args.connect_timeout, keys)) from None
            if interrupt.interrupted:
                return 130
            try:
                code = _print_stream(client.stream(prompt, request_id=request_id, **kwargs))
            except TimeoutError:
                raise CommandError(
                    f"the request did not end within --timeout {args.timeout:g}s; it was cancelled"
                ) from None
        except CommandError:
            if interrupt.interrupted:
                return 130  # however the cancelled request ended, the user asked to stop
            raise
    return 130 if interrupt.interrupted else code


class CancelOnInterrupt:
    """While active, Ctrl-C cancels ``request_id`` through the daemon instead of raising in the
    middle of a client call: the stream then ends (``cancelled``) the ordinary way, and the client
    closes with nothing left half-done. A second Ctrl-C, or no end within ``grace`` seconds (a
    daemon that is gone cannot confirm), raises ``KeyboardInterrupt`` as usual (``open_client``)."""

    def __init__(self, client: Client, request_id: str, grace: float = CLOSE_WITHIN_S) -> None:
        self.client = client
        self.request_id = request_id
        self.grace = grace
        self.interrupted = False
        self._timer: threading.Timer | None = None
        self._previous: Any = None

    def __enter__(self) -> CancelOnInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)
        if self._timer is not None:
            self._timer.cancel()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        threading.Thread(target=self._cancel, name="mlx-batchd-cancel", daemon=True).start()
        # A real signal, aimed at the main thread, so it also wakes a call blocked there.
        main = threading.main_thread().ident
        assert main is not None
        self._timer = threading.Timer(self.grace, signal.pthread_kill, (main, signal.SIGINT))
        self._timer.daemon = True
        self._timer.start()

    def _cancel(self) -> None:
        with contextlib.suppress(Exception):
            self.client.cancel(self.request_id)


def _print_stream(events: Iterator[Any]) -> int:
    """Tokens to stdout as they come; the end (or the daemon's error) as one line on stderr."""
    from clients import EndEvent, TokenEvent

    for event in events:
        if isinstance(event, TokenEvent):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, EndEvent):
            sys.stdout.write("\n")
            if event.error is not None:
                raise CommandError(str(event.error))
            t = event.timings
            print(
                f"[{event.finish_reason}] {event.usage.get('prompt_tokens')} prompt + "
                f"{event.usage.get('completion_tokens')} generated tokens, "
                f"ttft {t.get('ttft_s') or 0:.3f}s, decode {t.get('decode_s') or 0:.3f}s",
                file=sys.stderr,
            )
    return 0


def _stats(args: argparse.Namespace) -> int:
    with open_client(args, timeout=args.timeout) as client:
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
    """The request options, with the ranges the daemon's protocol accepts (``clients.protocol``)."""
    p.add_argument("--max-tokens", type=positive_int, default=None)
    p.add_argument("--temperature", type=float_in(0.0, 100.0), default=0.0)
    p.add_argument("--top-p", type=float_in(0.0, 1.0, above=True), default=1.0)
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--min-p", type=fraction, default=0.0)
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--timeout", type=positive_float, default=None, help="seconds for the whole request")
    p.add_argument(
        "--priority",
        type=int_in(-1000, 1000),
        default=None,
        help="higher goes first within your tenant's share (capped by the tenant's max_priority)",
    )


#: The smallest ``--max-frame-bytes`` that still fits a short request with its options.
MIN_FRAME_BYTES = 1024


def _add_serve(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--model", default="demo", help="a local mlx-lm model directory, or 'demo' (default)")
    p.add_argument("--listen", default=None, help=f"ZeroMQ address to bind (default {default_address()})")
    p.add_argument("--max-batch", type=positive_int, default=32, help="most sequences decoded together")
    p.add_argument("--prefill-batch", type=positive_int, default=8, help="most prompts prefilled together")
    p.add_argument("--prefill-step", type=positive_int, default=2048, help="prompt tokens per prefill chunk")
    p.add_argument("--max-tokens-cap", type=positive_int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--default-max-tokens", type=positive_int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--context-length", type=positive_int, default=None, help="override the model's context length")
    p.add_argument(
        "--max-frame-bytes",
        type=int_in(MIN_FRAME_BYTES, 2**30),
        default=DEFAULT_MAX_FRAME_BYTES,
        help="largest request frame accepted",
    )
    p.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=0.0,
        help="on SIGTERM/SIGINT, let in-flight requests finish for up to this many seconds",
    )
    p.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the engine on a thread of the daemon instead of its own process (one GIL for both)",
    )
    p.add_argument(
        "--pin-scope",
        choices=["scoped", "process"],
        default="scoped",
        help="scoped: only verify forwards run pinned; process: every forward (the seed's way, for comparison)",
    )
    p.add_argument(
        "--probe-k",
        type=positive_int,
        default=None,
        help="without a drafter: probe the verify pairing for K drafted tokens at start-up",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="speculative drafter for B = 1 bursts: a draft model directory, 'demo' or 'prompt-lookup'",
    )
    p.add_argument("--mtp", default=None, help="an MTP head directory (or 'demo') as the drafter")
    p.add_argument(
        "-k", type=positive_int, default=4, help="drafted tokens per burst round (the verify block is K + 1)"
    )
    p.add_argument(
        "--audit-fraction",
        type=fraction,
        default=0.02,
        help="fraction of burst rounds re-checked against a single-token forward",
    )
    p.add_argument("--max-queued", type=positive_int, default=1024, help="requests waiting for a slot before `busy`")
    p.add_argument("--tenants", default=None, help="tenants TOML file (keys, weights, limits); reloaded on SIGHUP")
    p.add_argument("--curve-secret", default=None, help="the daemon's CURVE secret key file")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow tcp:// or a non-loopback --http without authentication (not recommended)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=non_negative_float,
        default=0.0,
        help="keep up to this much prompt KV for reuse by later requests sharing a prefix, per tenant "
        "(docs/prefix-cache.md); 0 = off",
    )
    p.add_argument(
        "--kv-budget-mb",
        type=non_negative_float,
        default=0.0,
        help="KV cache the admitted requests may reserve (prompt + max_tokens each); 0 = no cap",
    )
    p.add_argument(
        "--max-inflight-per-client",
        type=positive_int,
        default=256,
        help="requests one connection may have in flight before `busy`",
    )
    p.add_argument(
        "--max-unsent-per-client",
        type=positive_int,
        default=1000,
        help="messages queued for one slow reader before its sequences pause until it catches up",
    )
    p.add_argument(
        "--metrics", type=host_port, default=None, help="serve Prometheus metrics on HOST:PORT (e.g. 127.0.0.1:9464)"
    )
    p.add_argument(
        "--http",
        type=http_address,
        default=None,
        help="also serve the OpenAI-compatible HTTP API on HOST:PORT (e.g. 127.0.0.1:8000; docs/http.md)",
    )
    p.add_argument(
        "--http-body-timeout",
        type=positive_float,
        default=30.0,
        help="seconds an HTTP client has to send its request body (then 408)",
    )
    _add_probe_policy(p)
    p.set_defaults(func=local_command("serve", _serve))


def _add_local_tools(sub: argparse._SubParsersAction[Parser]) -> None:
    """probe, bench-bursts, synth, keys, demo and bench: the commands that need no running daemon."""
    p = sub.add_parser("probe", help="measure whether a verify block is byte-identical to classic decode, per level")
    p.add_argument("--model", default="demo")
    p.add_argument("--draft", default="none", help="the drafter of the pairing (part of the verdict's fingerprint)")
    p.add_argument(
        "-k", type=int_list(1), default="4", help="drafted tokens per round; a comma list probes several (2,3,4)"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--localize", action="store_true", help="name the first layer/op that diverges")
    p.add_argument("--force", action="store_true", help="re-probe even when a memoised verdict exists")
    p.add_argument("--no-store", action="store_true", help="neither read nor write memoised verdicts")
    _add_probe_policy(p)
    p.set_defaults(func=local_command("probe", _probe))

    p = sub.add_parser("bench-bursts", help="verify cost per level, B = 1 bursts vs classic, batched pin tax")
    p.add_argument("--model", default="demo")
    p.add_argument(
        "--draft", action="append", default=[], help="drafter spec (repeatable): directory, demo, prompt-lookup"
    )
    p.add_argument("--mtp", default=None)
    p.add_argument("-k", type=positive_int, default=4)
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
    p.set_defaults(
        func=local_command("bench-bursts", lambda a: __import__("scheduler.bench_bursts", fromlist=["main"]).main(a))
    )

    p = sub.add_parser("synth", help="write a random-weight model directory from a preset config")
    p.add_argument("--preset", required=True, help="a name from workers.synthetic.PRESETS (e.g. tiny-llama)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    p.set_defaults(func=local_command("synth", _synth))

    p = sub.add_parser("keys", help="CURVE keys for tenants and the daemon")
    keys = p.add_subparsers(dest="keys_command", required=True)
    k = keys.add_parser("new", help="write NAME.key (public) and NAME.key_secret")
    k.add_argument("name")
    k.add_argument("--dir", default=".")
    k.add_argument("--force", action="store_true", help="replace an existing pair of that name")
    k.set_defaults(func=local_command("keys", _keys))
    k = keys.add_parser("new-api", help="print a fresh HTTP API key once, and the tenants.toml line with its hash")
    k.add_argument("name", help="the tenant the key is for")
    k.set_defaults(func=local_command("keys", _keys_new_api))

    p = sub.add_parser("demo", help="start a daemon on the demo model and run concurrent jobs through it")
    p.add_argument("--model", default="demo")
    p.add_argument(
        "--max-tokens", type=positive_int, default=160, help="per request (the demo model's tokens are bytes)"
    )
    p.add_argument(
        "--drafter", default="mtp", help="mtp (the demo MTP head), demo (draft model), prompt-lookup or none"
    )
    p.set_defaults(func=local_command("demo", _demo))

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
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument(
        "--out", default=BENCH_OUT, help=f"folder for JSON, Markdown and PNG results (default ./{BENCH_OUT})"
    )
    p.add_argument(
        "--drafters",
        "--draft",
        default="",
        help="comma list of drafters for the B = 1 burst rows, one daemon each: DIR, demo, prompt-lookup, mtp:DIR|mtp:demo",
    )
    p.add_argument(
        "--poisson-rate",
        type=non_negative_float,
        default=0.0,
        help="also run mixed Poisson arrivals at this rate/s",
    )
    p.add_argument("--poisson-requests", type=positive_int, default=40)
    p.add_argument(
        "--process-pin",
        default=None,
        choices=["narrow", "per-query"],
        help="also measure a daemon with --pin-scope process at this level (the tax scoping avoids)",
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
        help="memory bandwidth in GB/s for the physical reference beside each row, e.g. 4800 for an H200; 0 = omit",
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
    p.set_defaults(func=local_command("bench", lambda a: __import__("scheduler.bench", fromlist=["main"]).main(a)))


def _add_daemon_clients(sub: argparse._SubParsersAction[Parser]) -> None:
    """generate and stats (top registers itself, in scheduler.top): the commands that need a daemon."""
    p = sub.add_parser("generate", help="send one prompt to a running daemon and stream the answer")
    p.add_argument("prompt")
    p.add_argument("--addr", default=None, help="daemon address (default: the local ipc socket)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    p.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=10.0,
        help="seconds the daemon has to answer a health check first",
    )
    _add_sampling(p)
    _add_client_auth(p)
    p.set_defaults(func=daemon_command("generate", _generate))

    p = sub.add_parser("stats", help="print a running daemon's health and counters")
    p.add_argument("--addr", default=None)
    p.add_argument("--timeout", type=positive_float, default=10.0)
    p.add_argument("--json", action="store_true", help="the raw health and stats replies")
    p.add_argument("--measure-tax", action="store_true", help="time a batched step pinned vs wide first")
    p.add_argument("--tax-wait", type=non_negative_float, default=2.0, help="seconds to let that measurement run")
    _add_client_auth(p)
    p.set_defaults(func=daemon_command("stats", _stats))


def build_parser() -> Parser:
    parser = Parser(prog="mlx-batchd", description="A batching daemon for MLX models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_local_tools(sub)
    _add_daemon_clients(sub)
    __import__("scheduler.top", fromlist=["add_parser"]).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
