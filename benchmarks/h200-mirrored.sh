#!/usr/bin/env bash
# Device call (docs/benchmarks.md section 11): the mirrored rung on the H200 (issue 14): does the
# project's kernel reproduce MLX's one-row call on each 8B layer shape; whole-model verify cost; the
# probe's verdict; B = 1 prompt-lookup bursts through the daemon. Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
step rowkernel 110 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --quick --out "$R/rowkernel.json"
step probe-8b-k4 100 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k 4 --no-store
step b1-8b 200 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
  --tokens 256 --repeats 3 --out "$R/b1-8b"
rm -f "$R"/b1-8b/*.png
