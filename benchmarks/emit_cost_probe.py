"""What handing one step's events from the engine process to the daemon costs the engine thread, by piece.

    python benchmarks/emit_cost_probe.py --model demo
    python benchmarks/emit_cost_probe.py --model "$M" --out emit.json

Each piece is timed ``--n`` times with a pause of ``--gap-ms`` before each call, so the reader on
the other side has gone idle, as it has between decode steps: the engine's stats snapshot, packing
it, packing a B = 1 step's events, a B = 128 step's events as a map a token and as columns (and
reading each back into events, the front end's side), a ZeroMQ PUSH send over ipc to a PULL in
another process, and a write of the same bytes to an OS pipe read by another process
(``scheduler.event_pipe``, what the engine process sends with). Medians, 90th percentiles and maxima
in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq  # noqa: E402

from scheduler.engine_process import pack, unpack  # noqa: E402
from scheduler.event_pipe import PipeWriter, open_pipe  # noqa: E402
from workers.api import EngineSettings, Ready, Signal, StepInfo, StepKind, TokenMode, Tokens, from_wire, to_wire
from workers.api.wire import _signal_from_wire as signal_from_wire
from workers.api.wire import _signal_to_wire as signal_to_wire
from workers.engine.loop import EngineThread
from workers.models.loading import load  # noqa: E402

ZMQ_READER = """
import sys, zmq
s = zmq.Context().socket(zmq.PULL)
s.bind(sys.argv[1])
while s.recv() != b"end":
    pass
"""
PIPE_READER = """
import os, sys
fd = int(sys.argv[1])
while os.read(fd, 1 << 20):
    pass
"""


def timed(name: str, fn: Callable[[], Any], n: int, gap_s: float) -> dict[str, float]:
    took = []
    for _ in range(n):
        time.sleep(gap_s)
        tic = time.perf_counter()
        fn()
        took.append(time.perf_counter() - tic)
    took.sort()
    row = {"median_us": 1e6 * took[n // 2], "p90_us": 1e6 * took[int(0.9 * n)], "max_us": 1e6 * took[-1]}
    print(
        f"{name:36s} median {row['median_us']:8.1f} us  p90 {row['p90_us']:8.1f}  max {row['max_us']:8.1f}", flush=True
    )
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--gap-ms", type=float, default=5.0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    n, gap = a.n, a.gap_ms / 1e3
    loaded = load(a.model, None)
    ready = threading.Event()

    def emit(signals: list[Signal]) -> None:
        if any(isinstance(s, Ready) for s in signals):
            ready.set()

    engine = EngineThread(lambda: loaded, emit, EngineSettings())
    engine.start()
    if not ready.wait(600):
        raise SystemExit("the engine did not get ready")
    step: list[Signal] = [
        Tokens(seq=1, tokens=[5], logprobs=None, mode=TokenMode.BATCHED, top_logprobs=None),
        StepInfo(kind=StepKind.DECODE, seconds=0.005, batch_size=1),
    ]
    msg = {"events": [signal_to_wire(s) for s in step]}
    rows = {
        "snapshot": timed("engine snapshot", engine.snapshot, n, gap),
        "pack_snapshot": timed("build and pack the snapshot", lambda: pack(engine.snapshot()), n, gap),
        "pack_events": timed("pack a B = 1 step's events", lambda: pack(msg), n, gap),
    }
    # A B = 128 decode step's events, each token as its own map against a run of them as columns
    # (``workers.api.to_wire``), and the front end's reading them back into events.
    wide: list[Signal] = [StepInfo(StepKind.DECODE, 0.03, 128), *(Tokens(i, [1000 + i]) for i in range(128))]
    as_maps = [signal_to_wire(s) for s in wide]
    maps_frame, columns_frame = pack({"events": as_maps}), pack({"events": to_wire(wide)})
    rows["b128_maps"] = timed(
        "B = 128 step's events as maps", lambda: pack({"events": [signal_to_wire(s) for s in wide]}), n, gap
    )
    rows["b128_columns"] = timed("B = 128 step's events as columns", lambda: pack({"events": to_wire(wide)}), n, gap)
    rows["b128_read_maps"] = timed(
        "read back B = 128 maps",
        lambda: [signal_from_wire(d) for d in unpack(maps_frame)["events"]],
        n,
        gap,
    )
    rows["b128_read_columns"] = timed(
        "read back B = 128 columns", lambda: from_wire("signals", unpack(columns_frame)["events"]), n, gap
    )
    rows["b128_bytes"] = {"maps": len(maps_frame), "columns": len(columns_frame)}
    frame = pack(msg)
    with tempfile.TemporaryDirectory() as folder:
        address = f"ipc://{folder}/events"
        reader = subprocess.Popen([sys.executable, "-c", ZMQ_READER, address])
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(address)
        time.sleep(1.0)
        rows["zmq_send"] = timed("ZeroMQ PUSH send, reader idle", lambda: push.send(frame, zmq.NOBLOCK), n, gap)
        rows["zmq_send_busy"] = timed("ZeroMQ PUSH send, back to back", lambda: push.send(frame), n, 0.0)
        push.send(b"end")
        reader.wait(30)
        push.close(linger=0)
        ctx.term()
    r, w = open_pipe()
    reader = subprocess.Popen([sys.executable, "-c", PIPE_READER, str(r)], pass_fds=(r,))
    os.close(r)
    time.sleep(0.5)
    rows["pipe_write"] = timed("pipe write, reader idle", lambda: os.write(w, frame), n, gap)
    writer = PipeWriter(w)
    rows["pipe_send"] = timed("PipeWriter.send (packs), reader idle", lambda: writer.send(msg), n, gap)
    writer.close()
    reader.wait(30)
    engine.shutdown()
    engine.join(30)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
