#!/usr/bin/env bash
# Device call (docs/benchmarks.md section 11): the row-exact kernel's variants and the whole-model
# verify cost at rowwise (issue 14), where the daemon's engine loses step time with profiles of both
# engines (issue 15), and B = 1 prompt-lookup bursts through the daemon at rowwise (issue 14).
# Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
step rowkernel 150 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --out "$R/rowkernel.json"
step gap 130 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 64 --repeats 2 \
  --arms main,process,daemon,daemon-1client --out "$R/gap.json" --profile-dir "$R/prof"
step b1-8b 320 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
  --tokens 256 --repeats 3 --out "$R/b1-8b"
