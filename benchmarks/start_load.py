"""Classic requests while a daemon's start-up work runs (kernel plans, the prefix cache's check, the
probe), against the same requests once it is done: what share of their speed the background work takes.

Waves of two concurrent requests (B = 2: classic decode, no burst) are sent from the moment health
says ready until the daemon is idle, then as many again (at least 3, at most 8) once it is; each wave's
generated tokens a second. Point ``MLX_BATCHD_CACHE`` at an empty folder for the work of a first start.

    MLX_BATCHD_CACHE=$(mktemp -d) python benchmarks/start_load.py MODEL [--waves N] [serve options...]

``--waves N``: at most N waves during the work (a slow machine's work at the engine's busy share can
outlast the time there is to measure it; the "after" part is then skipped while work remains) and N
after it. A daemon with no start-up work (no drafter, ``--prefix-cache-mb 0``) gives its waves as
"after": the reference the issue names.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from clients.events import RequestError
from clients.sync import Client
from scheduler.bench.arms import _idle
from scheduler.spawn import DaemonProcess

#: Tokens each request generates, and the requests of a wave.
TOKENS = 32
WAVE = 2


def wave(client: Client, i: int) -> float:
    """One wave's generated tokens a second (prompts of small ids, in every vocabulary)."""
    prompts = [[1 + (i + j) % 7, 2, 3, 4, 5, 6, 7, 8] for j in range(WAVE)]
    tic = time.perf_counter()
    done = client.generate_many([{"tokens": p, "max_tokens": TOKENS, "ignore_eos": True} for p in prompts])
    return sum(len(r.tokens) for r in done) / (time.perf_counter() - tic)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f}, {len(xs)} waves)"


def main() -> None:
    model, extra = sys.argv[1], sys.argv[2:]
    cap = None
    if extra[:1] == ["--waves"]:
        cap, extra = int(extra[1]), extra[2:]
    after: list[float] = []
    with DaemonProcess(model, f"ipc://{tempfile.mkdtemp()}/d.sock", *extra) as proc:
        with Client(proc.address, timeout=3600) as client:
            during: list[float] = []
            idle = _idle(client.stats()["engine"])
            while not idle and (cap is None or len(during) < cap):
                during.append(wave(client, len(during)))
                print(f"during start-up work, wave {len(during)}: {during[-1]:.2f} tok/s", flush=True)
                idle = _idle(client.stats()["engine"])
            idle_s = time.monotonic() - proc.spawned_at
            if idle:
                after = [wave(client, i) for i in range(cap or min(8, max(3, len(during))))]
    print(
        f"ready {proc.ready_seconds:.1f} s, " + (f"idle {idle_s:.1f} s after spawn" if idle else "work still pending")
    )
    print(
        f"B = {WAVE}, {TOKENS} tokens a request: during the work {spread(during) if during else '-'}; "
        f"after {spread(after) if after else '-'}"
    )
    if during and after:
        print(f"during / after (medians): {statistics.median(during) / statistics.median(after):.3f}")


if __name__ == "__main__":
    try:
        main()
    except RequestError as exc:  # e.g. the engine died under the work: one line, not a traceback
        sys.exit(f"start_load: a request failed: {exc}")
