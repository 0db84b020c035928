#!/usr/bin/env bash
# Device calls (docs/benchmarks.md section 12). PART=a: the mirrored kernel at 1, 2, 4 outputs per warp
# (issue 14); the daemon with and without admission waves against the engine alone (issue 15); the
# prefix cache's B = 16 throughput at a 0 % hit rate (issue 17). PART=b: the whole bench matrix
# (issue 15) with each process's GPU memory sampled by nvidia-smi. PART=m: the mirrored rung at its new
# default (4 outputs per warp): whole-model verify cost, the probe, B = 1 prompt lookup through the
# daemon (issue 14). Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
if [ "${PART:-a}" = a ]; then
  step rowkernel 120 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --quick --out "$R/rowkernel.json"
  step gap 240 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 16,64 --repeats 2 \
    --arms main,daemon@0,daemon@20 --out "$R/gap.json"
  step prefix-tp 200 python3 -m scheduler bench --prefix-scenario --prefix-parts throughput --prefix-allow-inexact \
    --model /tmp/m8b --repeats 3 --out "$R/prefix-tp"
  rm -f "$R"/prefix-tp/*.png
elif [ "$PART" = m ]; then
  step whole 150 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --quick --whole-only --out "$R/whole.json"
  step b1-8b 240 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
    --tokens 256 --repeats 3 --bandwidth-gbs 4800 --out "$R/b1-8b"
  rm -f "$R"/b1-8b/*.png
else
  (while sleep 4; do date +%T; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; done) \
    > "$R/gpu-memory.log" 2>&1 &
  step bench 560 python3 -m scheduler bench --model /tmp/m8b --batch-sizes "${BATCHES:-1,4,8,16,32,64,128}" \
    --tokens 64 --repeats "${REPEATS:-3}" --poisson-rate 4 --poisson-requests 32 --bandwidth-gbs 4800 \
    ${BENCH_ARGS:-} --out "$R/bench"
  kill %1
  rm -f "$R"/bench/*.png
fi
