"""A daemon's start, twice on one cache folder: seconds from spawn to health answering ``ready``, to the
first token of a one-token request sent then, and to idle (``stats.engine.start_up`` and the probe
done). Point ``MLX_BATCHD_CACHE`` at an empty folder for a first start as on a fresh machine.

    MLX_BATCHD_CACHE=$(mktemp -d) python benchmarks/start_times.py MODEL [serve options...]
"""

import sys
import tempfile
import time

from clients.sync import Client
from scheduler.bench.arms import _idle
from scheduler.spawn import DaemonProcess

model = sys.argv[1]
extra = sys.argv[2:]
for start in ("first", "second"):
    sock = f"ipc://{tempfile.mkdtemp()}/d.sock"
    with DaemonProcess(model, sock, *extra) as proc:
        proc.wait_ready(timeout=900)
        ready = proc.ready_seconds
        with Client(proc.address, timeout=600) as c:
            c.generate("Hello", max_tokens=1)
            first = time.monotonic() - proc.spawned_at
            while not _idle(c.stats()["engine"]):
                time.sleep(0.2)
            idle = time.monotonic() - proc.spawned_at
            su = c.stats()["engine"].get("start_up")
    print(
        f"{start} start: ready {ready:.1f} s, first token {first:.1f} s, idle {idle:.1f} s; start_up {su}", flush=True
    )
