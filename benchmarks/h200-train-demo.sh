#!/usr/bin/env bash
# Device call (see docs/demo-models.md): install MLX CUDA from .mlx-cuda/part2 (a wheel set staged beside
# the checkout, not in the repository: the device has no network), train the demo set from the stdlib
# archive an earlier call staged in $CORPUS (default ~/corpus), pack the weights into $OUT (split, at most
# 8 files back). Working files go to a fresh `mktemp -d` folder.
# Usage on the device:
#   bash benchmarks/h200-train-demo.sh [tools.demo.train flags]         one run: $OUT/weights.tar.*
#   RUNS=1 bash benchmarks/h200-train-demo.sh "flags a" "flags b" ...   runs side by side on the one GPU
#                                                                       (small models leave it mostly idle):
#                                                                       runs/1, 2, ... in $OUT/runs.tar.*
set -uo pipefail
export SITE=${SITE:-${TMPDIR:-/tmp}/site}
bash .mlx-cuda/part2/install-on-device.sh || exit 3
W=$(mktemp -d)
mkdir -p "$W/pkg/tools/demo" "$W/pkg/workers/demo" "$W/stdlib"
# Only the training modules and the two workers modules they import travel to $W/pkg, so nothing else
# of the daemon is imported there.
cp tools/demo/{train,tokenizer,corpus,models,phases,objectives}.py "$W/pkg/tools/demo/" || exit 3
cp workers/models/mtp.py "$W/pkg/workers/" && cp workers/models/demo/__init__.py "$W/pkg/workers/demo/" || exit 3
touch "$W/pkg/tools/__init__.py" "$W/pkg/tools/demo/__init__.py" "$W/pkg/workers/__init__.py"
tar xJf "${CORPUS:-$HOME/corpus}/stdlib.tar.xz" -C "$W/stdlib" || exit 4
export PYTHONPATH=$SITE:$W/pkg PYTHONUNBUFFERED=1
train() { (cd "$W" && timeout "${TRAIN_TIMEOUT:-520}" python3 -m tools.demo.train --stdlib "$W/stdlib" "$@"); }
if [ -z "${RUNS:-}" ]; then
  train --out "$W/weights" "$@"
  rc=$?
  (cd "$W" && tar cf - weights | split -b 15m - "$OUT/weights.tar.")
  exit $rc
fi
pids=()
i=0
for flags in "$@"; do
  i=$((i + 1))
  mkdir -p "$W/runs/$i"
  # shellcheck disable=SC2086  # each argument is one run's whole flag string
  train --out "$W/runs/$i" $flags >"$W/runs/$i/stdout" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for d in "$W"/runs/*/; do echo "== $d"; tail -n 12 "$d/stdout"; done
(cd "$W" && tar cf - runs | split -b 15m - "$OUT/runs.tar.")
exit $rc
