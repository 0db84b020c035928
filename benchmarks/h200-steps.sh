# Sourced by the device scripts that run timed steps (h200-padded.sh, h200-rowwise.sh): MLX CUDA in
# /tmp/site (installed by an earlier call on the same warm machine, or part2 carried), the
# environment, the 8B synth at /tmp/m8b, and `step`, which runs a command within what is left of BUDGET.
# MLX's compiled kernels from an earlier machine, where carried (.mlx-cuda/ptx): spares minutes of JIT.
[ -f .mlx-cuda/ptx/ptx.tgz ] && [ ! -d /tmp/mlx ] && tar xzf .mlx-cuda/ptx/ptx.tgz -C /tmp
[ -d /tmp/site/mlx ] || bash .mlx-cuda/part2/install-on-device.sh || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_BATCHD_CACHE=/tmp/mbc
R=$OUT/r && mkdir -p $R
# The project kernel's outputs per warp by rows, as an earlier call on this machine measured them (part w).
if [ -z "${MLX_BATCHD_QMV_PER_WARP:-}" ] && [ -s /root/qmv-per-warp ]; then
  export MLX_BATCHD_QMV_PER_WARP=$(cat /root/qmv-per-warp)
fi
# The project kernel's fastest exact launch settings by rows, as an earlier call measured them (part qv).
if [ -z "${MLX_BATCHD_QMV_WARPS:-}" ] && [ -s /root/qmv-env ]; then
  source /root/qmv-env
fi
echo "MLX_BATCHD_QMV_PER_WARP=${MLX_BATCHD_QMV_PER_WARP:-} WARPS=${MLX_BATCHD_QMV_WARPS:-}"
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
# The GPU's clocks, power and load every 0.5 s for the whole call (gpu.csv): whether a step that moves
# between runs (section 34: a B = 1 step at 4.4 ms in one run, 7.5 in the next) moves with the clocks.
GPULOG_PID=
if [ "${GPULOG:-1}" = 1 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv,nounits -lms 500 > "$R/gpu.csv" 2>/dev/null &
  GPULOG_PID=$!
  trap '[ -n "$GPULOG_PID" ] && kill "$GPULOG_PID" 2>/dev/null' EXIT  # also when a script ends without finish
fi
finish() { # what every call brings back besides its steps' output: the kernel plans and MLX's compiled kernels
  [ -n "$GPULOG_PID" ] && kill "$GPULOG_PID" 2>/dev/null
  rm -f "$R"/*/*.png
  find /tmp/mbc -name '*.json' -path '*kernel-plans*' -exec cp {} "$R/" \; 2>/dev/null
  tar czf "$OUT/ptx.tgz" -C /tmp mlx 2>/dev/null
}
