#!/usr/bin/env bash
# Device call (docs/benchmarks.md section 11): the mirrored rung on the H200 (issue 14: does the
# project's kernel reproduce MLX's one-row call; whole-model verify cost; the probe's verdict; B = 1
# prompt-lookup bursts through the daemon), then the daemon/engine gap with both engines profiled and
# the GPU's per-process use sampled (issue 15). Runs from the repository root.
set -uo pipefail
source benchmarks/h200-steps.sh
step rowkernel 150 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --out "$R/rowkernel.json"
step probe-8b-k4 80 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k 4 --no-store
step b1-8b 200 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
  --tokens 256 --repeats 3 --out "$R/b1-8b"
nvidia-smi pmon -s um -d 1 > "$R/pmon.log" 2>&1 &
PMON=$!
step gap 150 python3 benchmarks/engine_gap_probe.py --model /tmp/m8b --batches 64 --repeats 1 \
  --arms main,process,daemon,daemon-1client --out "$R/gap.json" --profile-dir "$R/prof"
kill $PMON 2>/dev/null
tar czf "$R/prof.tgz" -C "$R" prof 2>/dev/null && rm -rf "$R/prof"
rm -f "$R"/b1-8b/*.png
