#!/usr/bin/env bash
# Device calls for the next session (issues 14 and 15), run from the repository root after MLX CUDA is
# staged (as for h200-s9.sh; carry .mlx-cuda/ptx too, whose compiled kernels spare a fresh machine
# minutes). PART=v: the verify at mirrored with everything in (fused projections, 3 queries per
# attention call now that cuDNN attention is off in every process that loads a model, one cache
# update per block), against it unfused; the probe; B = 1 prompt lookup over 1,024 tokens (does the
# random-weight synth's greedy output fall into loops that prompt lookup can draft?). PART=m: the
# whole bench matrix at the new defaults (issue 15's table). PART=d: the demo pair with its MTP head.
set -uo pipefail
[ -f .mlx-cuda/ptx/ptx.tgz ] && [ ! -d /tmp/mlx ] && tar xzf .mlx-cuda/ptx/ptx.tgz -C /tmp
source benchmarks/h200-steps.sh
if [ "${PART:-v}" = v ]; then
  step rowkernel 150 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --quick --whole-only --out "$R/rowkernel.json"
  step probe 60 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k 4 --no-store
  step bench1 330 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
    --tokens 1024 --repeats 3 --raw-max-batch 1 --out "$R/bench1"
elif [ "$PART" = m ]; then
  step matrix 560 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1,4,8,16,32,64,128 --tokens 64 \
    --repeats 3 --raw-max-batch 32 --out "$R/matrix"
elif [ "$PART" = d ]; then
  step demo-mtp 300 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo,prompt-lookup \
    --tokens 256 --repeats 3 --raw-max-batch 1 --out "$R/demo-mtp"
  step demo 120 python3 -m scheduler demo
fi
rm -f "$R"/*/*.png
