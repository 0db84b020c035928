"""Device measurement: is a fresh daemon's time to first token under Poisson arrivals paid per new
prompt length?

    python benchmarks/ttft_probe.py --model /tmp/m8b --out ttft.json

One daemon, three runs of the bench's Poisson arrivals one after another: random prompt lengths
(4-63 tokens), then every prompt 32 tokens, then the first run's arrivals again (the same lengths,
now seen once). If the repeat is as fast as the one-length run and the first run slower, the first
use of each prompt length costs time (kernels or attention graphs built per shape); if all three
match, the time to first token is the engine's scheduling.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from scheduler.bench.poisson import run_poisson
from scheduler.spawn import DaemonProcess


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="mlx-batchd-ttft-"))
    proc = DaemonProcess(a.model, f"ipc://{folder / 'd.sock'}")
    proc.wait_ready()
    runs = {}
    try:
        for name, lengths in (("random", (4, 64)), ("one-length", (32, 32)), ("random-again", (4, 64))):
            r = run_poisson(proc.address, a.rate, a.requests, a.vocab, a.tokens, prompt_lengths=lengths)
            runs[name] = r
            print(
                f"{name}: ttft p50 {1e3 * r['ttft_p50']:.1f} ms p90 {1e3 * r['ttft_p90']:.1f}, "
                f"itl p50 {1e3 * r['itl_p50']:.1f} ms p90 {1e3 * r['itl_p90']:.1f}",
                flush=True,
            )
    finally:
        proc.stop()
    Path(a.out).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
