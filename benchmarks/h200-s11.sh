#!/usr/bin/env bash
# Device calls (docs/benchmarks.md section 16), run from the repository root after MLX CUDA is staged
# (as for h200-s10.sh; carry .mlx-cuda/ptx too).
# PART=v: the mirrored kernel with U weight tiles loaded ahead (qmv_rows.UNROLL) per projection shape
# and row count against MLX's cheapest way, the whole model at wide / wide with every projection
# planned to the kernel / mirrored for U = 1, 2, 4; then, with the U whose 5-token mirrored block
# was cheapest, the probe and B = 1 prompt lookup over 1,024 tokens.
# PART=a: where a batched decode step's time goes (benchmarks/step_anatomy.py), then the demo pair
# with its MTP head (128 tokens).
# PART=m: the whole bench matrix (kernel plans timed with the kernel as a way; U from $U).
# PART=d: the demo pair with its MTP head, and `mlx-batchd demo`.
# Not run yet: PART=n, after the shared padding, the honest pad timing and the verify's shorter graph
# building (commits b2e161b, 2b72b25): step_anatomy and layer_parts at B = 1-16, rowkernel_probe
# --quick (the verify's cost and build time); PART=m again with RAW=64 (raw up to B = 64, so the
# B = 64 target is read in one run).
set -uo pipefail
source benchmarks/h200-steps.sh
if [ "${PART:-v}" = v ]; then
  step rowkernel 240 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --quick --out "$R/rowkernel.json"
  U=$(python3 -c "
import json; w = json.load(open('$R/rowkernel.json'))['whole_model']
print(min((v['block5_ms'], k.rsplit('U', 1)[1]) for k, v in w.items() if k.startswith('mirrored-'))[1])" 2>/dev/null || echo 1)
  export MLX_BATCHD_QMV_UNROLL=$U && echo "U=$U"
  step probe 90 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k 4 --no-store
  step bench1 330 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
    --tokens 1024 --repeats 3 --raw-max-batch 1 --out "$R/bench1"
elif [ "$PART" = a ]; then
  step anatomy 200 python3 benchmarks/step_anatomy.py --model /tmp/m8b --out "$R/anatomy.json"
  step demo-mtp 300 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo,prompt-lookup \
    --tokens 128 --repeats 3 --raw-max-batch 1 --out "$R/demo-mtp"
elif [ "$PART" = n ]; then
  step anatomy 150 python3 benchmarks/step_anatomy.py --model /tmp/m8b --batches 1,2,4,8,16 --out "$R/anatomy.json"
  step parts 120 python3 benchmarks/layer_parts_probe.py --model /tmp/m8b --batches 1,4,16 --out "$R/parts.json"
  step rowkernel 240 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --quick --whole-only --out "$R/rowkernel.json"
elif [ "$PART" = m ]; then
  export MLX_BATCHD_QMV_UNROLL=${U:-1}
  step matrix 560 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1,4,8,16,32,64,128 --tokens 64 \
    --repeats 3 --raw-max-batch "${RAW:-32}" --out "$R/matrix"
elif [ "$PART" = d ]; then
  export MLX_BATCHD_QMV_UNROLL=${U:-1}
  step demo-mtp 300 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo,prompt-lookup \
    --tokens 256 --repeats 3 --raw-max-batch 1 --out "$R/demo-mtp"
  step demo 120 python3 -m scheduler demo
fi
finish
