#!/usr/bin/env bash
# Device calls (docs/benchmarks.md section 15), run from the repository root after MLX CUDA is staged
# (as for h200-s9.sh). PART=k: the mirrored rung with sibling projections in one kernel call and a
# verify block's queries grouped per attention call, against it unfused, in whole-model steps; the
# probe on the 8B synth with prompt lookup at K = 4; B = 1 prompt lookup through the daemon; Poisson
# arrivals and B = 4/16 daemon / engine alone with the new defaults (cuDNN attention off, a 10 ms idle
# admission window). MLX's compiled kernels (.mlx-cuda/ptx/ptx.tgz, from an earlier machine) are
# unpacked first where carried, so that a fresh machine does not compile them again.
set -uo pipefail
[ -f .mlx-cuda/ptx/ptx.tgz ] && [ ! -d /tmp/mlx ] && tar xzf .mlx-cuda/ptx/ptx.tgz -C /tmp
source benchmarks/h200-steps.sh
if [ "${PART:-k}" = k ]; then
  step rowkernel 120 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --quick --whole-only --out "$R/rowkernel.json"
  step probe 60 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k 4 --no-store
  step bench1 150 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
    --tokens 256 --repeats 3 --raw-max-batch 1 --out "$R/bench1"
  step poisson 70 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --repeats 1 --tokens 64 \
    --poisson-rate 4 --poisson-requests 32 --out "$R/poisson"
  step bench16 150 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 4,16 --tokens 64 --repeats 3 \
    --raw-max-batch 16 --out "$R/bench16"
  rm -f "$R"/*/*.png
fi
