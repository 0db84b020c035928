#!/usr/bin/env bash
# Device calls (docs/benchmarks.md section 15), run from the repository root after MLX CUDA is staged
# (as for h200-s9.sh; carry .mlx-cuda/ptx too, MLX's compiled kernels from an earlier machine).
# PART=k (run in section 15): the mirrored rung with sibling projections in one kernel call, against
# it unfused, in whole-model steps; the probe on the 8B synth with prompt lookup at K = 4; B = 1
# prompt lookup through the daemon; Poisson arrivals and B = 4/16 at the new defaults (cuDNN attention
# off, a 10 ms idle admission window).
# Not run yet: PART=v, the verify with everything in (fused projections, 3 queries per attention call
# now that every process that loads a model has cuDNN attention off, one cache update per block), the
# probe, and B = 1 prompt lookup over 1,024 tokens (does the random-weight synth's greedy output fall
# into loops that prompt lookup can draft?); PART=m, the whole bench matrix at the new defaults
# (issue 15's table); PART=d, the demo pair with its MTP head, and `mlx-batchd demo`.
set -uo pipefail
source benchmarks/h200-steps.sh
if [ "${PART:-k}" = k ] || [ "$PART" = v ]; then
  step rowkernel 150 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --quick --whole-only --out "$R/rowkernel.json"
  step probe 60 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k 4 --no-store
  if [ "${PART:-k}" = k ]; then
    step bench1 150 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
      --tokens 256 --repeats 3 --raw-max-batch 1 --out "$R/bench1"
    step poisson 70 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --repeats 1 --tokens 64 \
      --poisson-rate 4 --poisson-requests 32 --out "$R/poisson"
    step bench16 150 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 4,16 --tokens 64 --repeats 3 \
      --raw-max-batch 16 --out "$R/bench16"
  else
    step bench1 330 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
      --tokens 1024 --repeats 3 --raw-max-batch 1 --out "$R/bench1"
  fi
elif [ "$PART" = m ]; then
  step matrix 560 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1,4,8,16,32,64,128 --tokens 64 \
    --repeats 3 --raw-max-batch 32 --out "$R/matrix"
elif [ "$PART" = d ]; then
  step demo-mtp 300 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo,prompt-lookup \
    --tokens 256 --repeats 3 --raw-max-batch 1 --out "$R/demo-mtp"
  step demo 120 python3 -m scheduler demo
fi
rm -f "$R"/*/*.png
