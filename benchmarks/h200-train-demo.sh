#!/usr/bin/env bash
# Device call (see docs/demo-models.md): install MLX CUDA from .mlx-cuda/part2, train the demo set from
# the stdlib archive staged at /root/corpus, pack the weights into $OUT (split, at most 8 files back).
# Usage on the device: bash benchmarks/h200-train-demo.sh [extra workers.demo.train flags]
set -uo pipefail
bash .mlx-cuda/part2/install-on-device.sh || exit 3
mkdir -p /tmp/pkg/workers/demo /tmp/stdlib
# Only the three training modules travel to /tmp/pkg, so nothing else of the package is imported there.
cp workers/mtp.py /tmp/pkg/workers/ && cp workers/demo/train.py workers/demo/tokenizer.py /tmp/pkg/workers/demo/
touch /tmp/pkg/workers/__init__.py /tmp/pkg/workers/demo/__init__.py
tar xJf /root/corpus/stdlib.tar.xz -C /tmp/stdlib || exit 4
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
(cd /tmp && timeout "${TRAIN_TIMEOUT:-520}" python3 -m workers.demo.train --stdlib /tmp/stdlib --out /tmp/weights "$@")
rc=$?
(cd /tmp && tar cf - weights | split -b 15m - "$OUT/weights.tar.")
exit $rc
