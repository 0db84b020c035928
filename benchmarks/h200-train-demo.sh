#!/usr/bin/env bash
# Device call (see docs/demo-models.md): install MLX CUDA from .mlx-cuda/part2 (a wheel set staged beside
# the checkout, not in the repository: the device has no network), train the demo set from the stdlib
# archive an earlier call staged at /root/corpus, pack the weights into $OUT (split, at most 8 files back).
# Usage on the device:
#   bash benchmarks/h200-train-demo.sh [tools.demo.train flags]         one run: $OUT/weights.tar.*
#   RUNS=1 bash benchmarks/h200-train-demo.sh "flags a" "flags b" ...   runs side by side on the one GPU
#                                                                       (small models leave it mostly idle):
#                                                                       /tmp/runs/1, 2, ... in $OUT/runs.tar.*
set -uo pipefail
bash .mlx-cuda/part2/install-on-device.sh || exit 3
mkdir -p /tmp/pkg/tools/demo /tmp/pkg/workers/demo /tmp/stdlib
# Only the training modules and the two workers modules they import travel to /tmp/pkg, so nothing else
# of the daemon is imported there.
cp tools/demo/{train,tokenizer,corpus,models,phases,objectives}.py /tmp/pkg/tools/demo/ || exit 3
cp workers/mtp.py /tmp/pkg/workers/ && cp workers/demo/__init__.py /tmp/pkg/workers/demo/ || exit 3
touch /tmp/pkg/tools/__init__.py /tmp/pkg/tools/demo/__init__.py /tmp/pkg/workers/__init__.py
tar xJf /root/corpus/stdlib.tar.xz -C /tmp/stdlib || exit 4
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
train() { (cd /tmp && timeout "${TRAIN_TIMEOUT:-520}" python3 -m tools.demo.train --stdlib /tmp/stdlib "$@"); }
if [ -z "${RUNS:-}" ]; then
  train --out /tmp/weights "$@"
  rc=$?
  (cd /tmp && tar cf - weights | split -b 15m - "$OUT/weights.tar.")
  exit $rc
fi
pids=()
i=0
for flags in "$@"; do
  i=$((i + 1))
  mkdir -p "/tmp/runs/$i"
  # shellcheck disable=SC2086  # each argument is one run's whole flag string
  train --out "/tmp/runs/$i" $flags >"/tmp/runs/$i/stdout" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for d in /tmp/runs/*/; do echo "== $d"; tail -n 12 "$d/stdout"; done
(cd /tmp && tar cf - runs | split -b 15m - "$OUT/runs.tar.")
exit $rc
