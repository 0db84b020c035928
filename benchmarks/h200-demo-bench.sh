#!/usr/bin/env bash
# Device call (see docs/benchmarks.md): the bench matrix on the shipped demo set, and a count of
# "terminate called without an active exception" (the CUDA exit abort) in the daemons' output.
# Needs MLX CUDA in /tmp/site (installed by an earlier call on the same warm machine, or part2 carried).
# Results (JSON, Markdown, PNG) come back as one archive, $OUT/results.tgz.
set -uo pipefail
[ -d /tmp/site/mlx ] || bash .mlx-cuda/part2/install-on-device.sh || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_BATCHD_CACHE=/tmp/mbc
R=/tmp/results && mkdir -p $R
timeout "${BENCH_TIMEOUT:-300}" python3 -m scheduler bench --model demo --drafters demo,mtp:demo \
  --batch-sizes 1,4,16 --tokens 256 --repeats 3 --out $R/h200-demo 2>$R/h200-demo.log
echo "bench rc=$?; 'terminate called' lines: $(grep -c 'terminate called' $R/h200-demo.log)"
grep -i "warning\|terminate" $R/h200-demo.log | tail -8
tar czf "$OUT/results.tgz" -C /tmp results
