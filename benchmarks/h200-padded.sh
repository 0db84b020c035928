#!/usr/bin/env bash
# Device call (docs/benchmarks.md section 10): the padded rung on the H200 (issue 14) and where the
# daemon's engine loses step time against the engine alone (issue 15). Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
for k in ${KS:-2 4 8}; do
  step probe-8b-k$k 60 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k "$k" --no-store
done
step probe-demo-k4 60 python3 -m scheduler probe --model demo --draft demo -k 4 --no-store
step gap 150 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --out "$R/gap.json"
step b1-8b 170 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
  --tokens 256 --repeats 3 --out "$R/b1-8b"
step b1-demo 150 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters demo,mtp:demo \
  --tokens 256 --repeats 3 --out "$R/b1-demo"
step verify-8b 100 python3 -m scheduler bench-bursts --model /tmp/m8b --draft prompt-lookup --ks 4,8 \
  --batch-sizes 1 --repeats 1 --tokens 64 --out "$R/verify-8b"
