#!/usr/bin/env bash
# Device call (docs/benchmarks.md section 10): the rowwise rung (project kernel) on the H200 (issue 14).
# Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
step rowkernel 120 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --out "$R/rowkernel.json"
step probe-8b-k4 90 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k 4 --no-store
step probe-demo-k4 60 python3 -m scheduler probe --model demo --draft demo -k 4 --no-store
step b1-8b 170 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
  --tokens 256 --repeats 3 --out "$R/b1-8b"
for k in 2 8; do
  step probe-8b-k$k 45 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k "$k" --no-store
done
step b1-demo 200 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo \
  --tokens 256 --repeats 3 --out "$R/b1-demo"
