#!/usr/bin/env bash
# Device calls (docs/benchmarks.md section 14). PART=a: with the kernel plans timed once per machine
# and shared by every process (workers/plan_store.py), the B = 16 daemon gap (issue 15) again: the
# engine alone, its loop on a thread, in its own process and the daemon side by side; the bench at
# B = 16; the prefix cache's B = 16 throughput at a 0 % hit rate (issue 17). Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
if [ "${PART:-a}" = a ]; then
  step gap16 280 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 16 --repeats 3 \
    --arms main,loop,process,daemon@20 --out "$R/gap16.json"
  cp -r "$MLX_BATCHD_CACHE/kernel-plans" "$R/" 2>/dev/null
  step bench16 140 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 16 --tokens 64 --repeats 3 \
    --raw-max-batch 1 --out "$R/bench16"
  step prefix 140 python3 -m scheduler bench --prefix-scenario --prefix-parts throughput --prefix-allow-inexact \
    --model /tmp/m8b --repeats 3 --out "$R/prefix"
  rm -f "$R"/*/*.png
fi
