#!/usr/bin/env bash
# Device call (docs/benchmarks.md section 8): the rowwise rung (project kernel) on the H200 (issue 14).
# Needs MLX CUDA in /tmp/site (installed by an earlier call on the same warm machine, or part2 carried).
set -uo pipefail
[ -d /tmp/site/mlx ] || bash .mlx-cuda/part2/install-on-device.sh || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_BATCHD_CACHE=/tmp/mbc
R=$OUT/r && mkdir -p $R
START=$SECONDS
step() { # NAME SECONDS COMMAND...: run with what is left of BUDGET at most; print rc and the log's tail
  local name=$1 t=$2; shift 2
  local left=$(( ${BUDGET:-560} - (SECONDS - START) ))
  if [ $left -lt 25 ]; then echo "$name: skipped (budget)"; return; fi
  [ "$t" -gt "$left" ] && t=$left
  timeout "$t" "$@" > "$R/$name.log" 2>&1
  echo "== $name rc=$? at $((SECONDS - START)) s"; tail -"${TAIL:-6}" "$R/$name.log"
}
[ -f /tmp/m8b/config.json ] || python3 -m scheduler synth --preset llama-8b-4bit --out /tmp/m8b >/dev/null || exit 4
step rowkernel 120 python3 benchmarks/rowkernel_probe.py --model /tmp/m8b --out "$R/rowkernel.json"
step probe-8b-k4 90 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k 4 --no-store
step probe-demo-k4 60 python3 -m scheduler probe --model demo --draft demo -k 4 --no-store
step b1-8b 170 python3 -m scheduler bench --model /tmp/m8b --batch-sizes 1 --drafters prompt-lookup \
  --tokens 256 --repeats 3 --out "$R/b1-8b"
for k in 2 8; do
  step probe-8b-k$k 45 python3 -m scheduler probe --model /tmp/m8b --draft prompt-lookup -k "$k" --no-store
done
step b1-demo 200 python3 -m scheduler bench --model demo --batch-sizes 1 --drafters mtp:demo \
  --tokens 256 --repeats 3 --out "$R/b1-demo"
