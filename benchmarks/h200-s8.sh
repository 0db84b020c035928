#!/usr/bin/env bash
# Device calls (docs/benchmarks.md section 13). PART=d: the whole-model verify with its graph-building
# time (issue 14); the bench's B = 16 arms with the daemon's engine thread profiled, and the gap
# probe's B = 16 arms profiled the same way, side by side (issue 15: the bench's daemon arm read
# 455 tok/s where the gap probe's read 572-618 in one session). PART=p: the prefix cache's B = 16
# throughput at a 0 % hit rate with 7 repeats (issue 17). Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
if [ "${PART:-d}" = d ]; then
  step whole 150 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --quick --whole-only --out "$R/whole.json"
  MLX_BATCHD_PROFILE_DIR=$R/bench-prof step bench16 200 python3 -m scheduler bench --model /tmp/m8b \
    --batch-sizes 16 --tokens 64 --repeats 3 --out "$R/bench16"
  step gap16 170 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 16 --repeats 2 \
    --arms main,daemon@20 --profile-dir "$R/gap-prof" --out "$R/gap16.json"
  rm -f "$R"/bench16/*.png "$R"/*/*.prof
else
  step prefix-tp 540 python3 -m scheduler bench --prefix-scenario --prefix-parts throughput --prefix-allow-inexact \
    --model /tmp/m8b --repeats 7 --out "$R/prefix-tp"
  rm -f "$R"/prefix-tp/*.png
fi
