#!/usr/bin/env bash
# Device calls (docs/benchmarks.md section 13). PART=d: the whole-model verify with its graph-building
# time (issue 14); the bench's B = 16 arms with the daemon's engine thread profiled, and the gap
# probe's B = 16 arms profiled the same way, side by side (issue 15: the bench's daemon arm read
# 455 tok/s where the gap probe's read 572-618 in one session). PART=p: the prefix cache's B = 16
# throughput at a 0 % hit rate with 7 repeats (issue 17). PART=f: what a finishing step costs with
# mlx-lm's per-layer filter and with the project's (B = 16, 64); the bench at B = 4, 16, 64 with the
# engine's prefill and finishing steps per run (issue 15). PART=q: the prefix cache's B = 16
# throughput with both daemons' engine threads profiled (issue 17), and Poisson arrivals twice (the
# first run compiles kernels for its new shapes; the second is the figure). PART=g: the B = 16 daemon
# gap (issue 15) taken apart: the bench's record of each process's calibrated row-count plans, then the
# engine alone, the engine in its own process and the daemon side by side, with the GPU's clocks and
# utilisation sampled. Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
if [ "${PART:-d}" = d ]; then
  step whole 150 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --quick --whole-only --out "$R/whole.json"
  MLX_BATCHD_PROFILE_DIR=$R/bench-prof step bench16 200 python3 -m scheduler bench --model /tmp/m8b \
    --batch-sizes 16 --tokens 64 --repeats 3 --out "$R/bench16"
  step gap16 170 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 16 --repeats 2 \
    --arms main,daemon@20 --profile-dir "$R/gap-prof" --out "$R/gap16.json"
  rm -f "$R"/bench16/*.png "$R"/*/*.prof
elif [ "$PART" = f ]; then
  step filter16 60 python3 benchmarks/filter_probe.py --model /tmp/m8b --batch 16 --out "$R/filter16.json"
  step filter64 90 python3 benchmarks/filter_probe.py --model /tmp/m8b --batch 64 --repeats 2 --out "$R/filter64.json"
  step bench 380 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 4,16,64 --tokens 64 --repeats 3 \
    --raw-max-batch 16 --bandwidth-gbs 4800 --out "$R/bench"
  rm -f "$R"/bench/*.png
elif [ "$PART" = g ]; then
  (while sleep 1; do nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw \
    --format=csv,noheader; done) > "$R/gpu.log" 2>&1 &
  step bench16 200 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 16 --tokens 64 --repeats 3 \
    --raw-max-batch 1 --out "$R/bench16"
  step gap16 300 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 16 --repeats 3 \
    --arms main,process,daemon@20 --out "$R/gap16.json"
  kill %1
  rm -f "$R"/bench16/*.png
elif [ "$PART" = q ]; then
  MLX_BATCHD_PROFILE_DIR=$R/prefix-prof step prefix-prof 150 python3 -m scheduler bench --prefix-scenario \
    --prefix-parts throughput --prefix-allow-inexact --model /tmp/m8b --repeats 3 --out "$R/prefix-prof"
  for run in warm figure; do
    step poisson-$run 120 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --repeats 1 --tokens 64 \
      --poisson-rate 4 --poisson-requests 32 --out "$R/poisson-$run"
  done
  rm -f "$R"/*/*.png "$R"/*/*.prof
else
  step prefix-tp 540 python3 -m scheduler bench --prefix-scenario --prefix-parts throughput --prefix-allow-inexact \
    --model /tmp/m8b --repeats 7 --out "$R/prefix-tp"
  rm -f "$R"/prefix-tp/*.png
fi
