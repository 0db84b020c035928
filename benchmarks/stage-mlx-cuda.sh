#!/usr/bin/env bash
# Re-split .mlx-cuda (from the shared prepare script) into three device calls: the repository's tracked
# files (~22 MB with the demo weights) plus one 44 MiB part no longer fit the 64 MiB a call carries.
# Afterwards: call 1 carries .mlx-cuda/part1, call 2 .mlx-cuda/part1b (both run
# `mkdir -p /root/mlx-stage && cp .mlx-cuda/part1*/* /root/mlx-stage/`), call 3 carries .mlx-cuda/part2 and
# runs the benchmark (its install joins every staged piece in name order).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)/.mlx-cuda"
[ -f part1/cuda.part.aa ] && [ -f part2/cuda.part.ab ] || { echo "run the shared prepare-mlx-cuda.sh first" >&2; exit 2; }
cat part1/cuda.part.aa part2/cuda.part.ab > whole.whl && rm part1/cuda.part.aa part2/cuda.part.ab
mkdir -p part1b && split -b 30m -a 2 whole.whl piece. && rm whole.whl
mv piece.aa part1/cuda.part.aa && mv piece.ab part1b/cuda.part.ab && mv piece.ac part2/cuda.part.ac
cat > part2/install-on-device.sh <<'INNER'
#!/usr/bin/env bash
set -euo pipefail
stage=/root/mlx-stage
[ -f "$stage/cuda.part.aa" ] && [ -f "$stage/cuda.part.ab" ] || { echo "staged parts missing: repeat calls 1 and 2" >&2; exit 3; }
name=$(cat .mlx-cuda/part2/WHEEL_NAME)
cat "$stage"/cuda.part.aa "$stage"/cuda.part.ab .mlx-cuda/part2/cuda.part.ac > "$stage/$name"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  "$stage/$name" .mlx-cuda/part2/mlx-*.whl .mlx-cuda/part2/mlx_lm-*.whl .mlx-cuda/part2/pyzmq-*.whl
PYTHONPATH=/tmp/site python3 -c "import mlx.core as mx; assert mx.cuda.is_available(); import zmq; print('mlx', mx.__version__, mx.default_device(), 'pyzmq', zmq.__version__)"
INNER
chmod +x part2/install-on-device.sh
du -sh part1 part1b part2
