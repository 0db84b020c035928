#!/usr/bin/env bash
# Device call: which exits of a process that ran MLX CUDA work print "terminate called without an
# active exception"? Plain main-thread use, a joined worker thread, a worker still alive at exit,
# os._exit, and the daemon after SIGTERM.
set -uo pipefail
[ -d /tmp/site/mlx ] || bash .mlx-cuda/part2/install-on-device.sh >/dev/null || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_BATCHD_CACHE=/tmp/mbc
W='mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))'
python3 -c "import mlx.core as mx; $W"; echo "== main thread only: rc=$?"
python3 -c "
import threading, mlx.core as mx
t = threading.Thread(target=lambda: $W); t.start(); t.join()"; echo "== worker thread, joined: rc=$?"
python3 -c "
import threading, time, mlx.core as mx
ev = threading.Event()
def work():
    $W; ev.set(); time.sleep(30)
threading.Thread(target=work, daemon=True).start(); ev.wait()"; echo "== worker thread alive at exit: rc=$?"
python3 -c "
import os, sys, threading, mlx.core as mx
t = threading.Thread(target=lambda: $W); t.start(); t.join(); sys.stdout.flush(); os._exit(0)"; echo "== worker joined, then os._exit: rc=$?"
python3 -m scheduler serve --model demo --listen ipc:///tmp/d.sock > /tmp/d.log 2>&1 &
pid=$!
for i in $(seq 90); do grep -q "ready" /tmp/d.log && break; sleep 1; done
python3 -m scheduler generate --addr ipc:///tmp/d.sock "def fibonacci(n):" --max-tokens 16; echo "== generate rc=$?"
kill -TERM $pid; wait $pid; echo "== daemon after SIGTERM: rc=$?"; tail -4 /tmp/d.log
