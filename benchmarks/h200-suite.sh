#!/usr/bin/env bash
# Device call (see docs/benchmarks.md): the bench suite on an 8B-shaped 4-bit llama with random weights.
# Needs MLX CUDA in /tmp/site (installed by an earlier call on the same warm machine, or part2 carried).
# Results (JSON, Markdown, PNG) come back as one archive, $OUT/results.tgz.
set -uo pipefail
[ -d /tmp/site/mlx ] || bash .mlx-cuda/part2/install-on-device.sh || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_BATCHD_CACHE=/tmp/mbc
R=/tmp/results && mkdir -p $R
python3 -m scheduler synth --preset llama-8b-4bit --out /tmp/m8b || exit 4
timeout "${BENCH_TIMEOUT:-360}" python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1,2,4,8,16,32 \
  --tokens 64 --repeats 3 --process-pin narrow --drafters prompt-lookup --poisson-rate 4 \
  --out $R/h200-suite 2>$R/h200-suite.log
echo "bench rc=$?"
timeout "${BURSTS_TIMEOUT:-150}" python3 -m scheduler bench-bursts --model /tmp/m8b --draft prompt-lookup \
  --ks 4,8 --batch-sizes 2,4 --batched-repeats 5 --out $R/h200-bursts-b2 2>$R/h200-bursts-b2.log
echo "bench-bursts rc=$?"
tail -5 $R/*.log
tar czf "$OUT/results.tgz" -C /tmp results
