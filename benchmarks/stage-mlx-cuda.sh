#!/usr/bin/env bash
# Split the MLX CUDA wheel set (from the shared prepare script) into three device calls: the
# repository's files (~20 MB) plus one part must stay under the 64 MiB a call carries. Also fetches the
# daemon's wheels a device machine lacks (starlette, uvicorn, sse-starlette, h11, click, llguidance, and
# pyelftools, without which the project's compiled kernels are not written to MLX's disk cache).
# Calls 1 and 2 carry .mlx-cuda/part1 and .mlx-cuda/part1b and run
# `mkdir -p ~/mlx-stage && cp .mlx-cuda/part1*/* ~/mlx-stage/`; call 3 carries .mlx-cuda/part2 and runs
# `bash .mlx-cuda/part2/install-on-device.sh` before the work (make each call within the machine's
# idle release, which can be 30 s). The install goes to $SITE (default
# $TMPDIR/site, else /tmp/site) and is skipped when already there.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root/.mlx-cuda"
if [ ! -f part1/w.a ]; then
  [ -f part1/cuda.part.aa ] && [ -f part2/cuda.part.ab ] || { echo "run the shared prepare-mlx-cuda.sh first" >&2; exit 2; }
  cat part1/cuda.part.aa part2/cuda.part.ab > whole.whl && rm part1/cuda.part.aa part2/cuda.part.ab
  mkdir -p part1b && split -b 32000000 -a 1 whole.whl piece. && rm whole.whl
  mv piece.a part1/w.a && mv piece.b part1b/w.b && mv piece.c part2/w.c
fi
"$root/.venv/bin/pip" download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform any -d part1b \
  starlette uvicorn sse-starlette h11 click "llguidance>=1.9,<2" "pyelftools>=0.31"
# SmolLM2-135M-Instruct's GGUF (the real model of the GPU agreement tests and of PART=sm), where this machine
# has it, in three pieces of ~33 MB (a call carries 64 MiB with the working tree's ~21 MB: .mlx-cuda/smol1,
# smol2, smol3, one staging call each).
gguf=${MLX_BATCHD_TEST_DATA:-$HOME/.cache/mlx-batchd-tests}/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$gguf" ] && [ ! -f smol3/s.c ]; then
  rm -rf smol1 smol2 && mkdir -p smol1 smol2 smol3 && split -n 3 -a 1 "$gguf" s. && mv s.a smol1/ && mv s.b smol2/ && mv s.c smol3/
fi
cat > part2/install-on-device.sh <<'INNER'
#!/usr/bin/env bash
set -euo pipefail
site=${SITE:-${TMPDIR:-/tmp}/site}
stage=~/mlx-stage
if [ ! -f "$site/.installed" ]; then
  [ -f "$stage/w.a" ] && [ -f "$stage/w.b" ] || { echo "staged parts missing: repeat calls 1 and 2" >&2; exit 3; }
  name=$(cat .mlx-cuda/part2/WHEEL_NAME)
  mkdir -p "$stage/joined"
  cat "$stage/w.a" "$stage/w.b" .mlx-cuda/part2/w.c > "$stage/joined/$name"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$stage/joined/$name" .mlx-cuda/part2/mlx-*.whl .mlx-cuda/part2/mlx_lm-*.whl .mlx-cuda/part2/pyzmq-*.whl \
    "$stage"/*.whl
  touch "$site/.installed"
fi
PYTHONPATH=$site python3 -c "import mlx.core as mx; assert mx.cuda.is_available(); import zmq, uvicorn, llguidance, elftools; print('mlx', mx.__version__, mx.default_device(), 'pyzmq', zmq.__version__)"
INNER
chmod +x part2/install-on-device.sh
du -sh part1 part1b part2 smol1 smol2 smol3 2>/dev/null
