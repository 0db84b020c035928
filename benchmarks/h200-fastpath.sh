#!/usr/bin/env bash
# Device call (docs/benchmarks.md): the batched kernel path on an 8B-shaped 4-bit llama with random weights.
# Runs from a snapshot of the committed tree in .snap (see docs/benchmarks.md for how it is made).
# Needs MLX CUDA in /tmp/site (installed by an earlier call on the same warm machine, or part2 carried).
set -uo pipefail
[ -d /tmp/site/mlx ] || bash .mlx-cuda/part2/install-on-device.sh || exit 3
cd "${SNAP:-.}"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_BATCHD_CACHE=/tmp/mbc
R=$OUT/r && mkdir -p $R
[ -f /tmp/m8b/config.json ] || python3 -m scheduler synth --preset llama-8b-4bit --out /tmp/m8b || exit 4
if [ "${PROBE:-1}" = 1 ]; then
  timeout "${PROBE_TIMEOUT:-200}" python3 benchmarks/fastpath_probe.py --model /tmp/m8b --out $R/fastpath-probe.json
  echo "probe rc=$?"
fi
timeout "${BENCH_TIMEOUT:-330}" python3 -m scheduler bench --model /tmp/m8b --batch-sizes "${BATCHES:-1,4,8,16,32,64,128}" \
  --tokens 64 --repeats 3 --poisson-rate "${POISSON_RATE:-4}" --poisson-requests 32 --bandwidth-gbs 4800 ${BENCH_ARGS:-} --out $R/bench 2>$R/bench.log
echo "bench rc=$?"
tail -3 $R/bench.log
