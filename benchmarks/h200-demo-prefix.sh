#!/usr/bin/env bash
# Device call (docs/benchmarks.md section 11): the demo pair's MTP bursts and `mlx-batchd demo` on the
# H200 (issue 14), and prefix reuse under --allow-inexact on the 8B synth (issue 17).
# Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
step b1-demo 200 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo \
  --tokens 256 --repeats 3 --out "$R/b1-demo"
step demo 120 python3 -m scheduler demo
step prefix 240 python3 -m scheduler bench --model /tmp/m8b --prefix-scenario --prefix-allow-inexact \
  --prefix-parts ttft,chat --repeats 3 --out "$R/prefix"
